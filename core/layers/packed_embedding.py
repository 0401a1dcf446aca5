"""An input embedding read from the rows of its tied LM head's packed weight: a 4-bit or 8-bit packed weight
(`fw.kernels.packed_int`'s layout) or a bf16 weight in fw's blocked dense layout (`fw.kernels.dense`).

Why: a tied head is kept in the layout its kernel reads every step (a GGUF's Q8_0 blocks; the dense
kernel's blocks of 48 rows), while the embedding only needs the step's rows. Looking them up in the head's
layout leaves no second copy of the vocabulary in memory (SmolLM2's is 56.6 MB in bf16), and a GGUF load never
dequantizes it. The values are the packed weight's exactly (`QuantBlocks.dequantize`, rounded once: the
embedding's own for Q4_0, Q4_1 and Q8_0), the same bf16 values for the dense layout.
"""

from __future__ import annotations

import torch
from torch import nn

from fw.errors import ModelLoadError
from fw.kernels.dense import DenseLayout, blocked_rows
from fw.kernels.packed_int import PackedWeight


ROW_BITS = (4, 8)  # the packed weights whose rows are read (fw.kernels.packed_int's rows_q4 and rows_q8)


def gather_rows(weight: PackedWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` (1-D) of a 4-bit or 8-bit packed weight, [len(ids), cols] in `dtype` (one C++ op,
    fw.kernels.packed_int)."""
    op = torch.ops.fw_packed_int.rows_q4 if weight.bits == 4 else torch.ops.fw_packed_int.rows_q8
    return op(weight.data, ids, weight.rows, weight.cols, dtype)


class PackedRowEmbedding(nn.Module):
    """`nn.Embedding`'s lookup over a 4-bit or 8-bit packed weight [vocab, hidden]."""

    def __init__(self, weight: PackedWeight, dtype: torch.dtype):
        super().__init__()
        if weight.bits not in ROW_BITS:
            raise ValueError(f"PackedRowEmbedding reads 4-bit and 8-bit packed weights, not {weight.bits!r}")
        self.packed = weight
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = weight.rows, weight.cols

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = gather_rows(self.packed, input_ids.reshape(-1), self.dtype)
        return rows.view(*input_ids.shape, self.embedding_dim)


class BlockedRowEmbedding(nn.Module):
    """`nn.Embedding`'s lookup over a bf16 weight [vocab, hidden] in fw's blocked dense layout."""

    def __init__(self, packed: torch.Tensor):
        super().__init__()
        self.packed = nn.Parameter(packed, requires_grad=False)  # the tied head's tensor: counted once, as weights
        self.num_embeddings, self.embedding_dim = packed.shape[0], 2 * packed.shape[1]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return blocked_rows(self.packed, input_ids.reshape(-1)).view(*input_ids.shape, self.embedding_dim)


def embedding_from_tied_head(model: nn.Module) -> bool:
    """When a tied LM head was packed into the blocked bf16 layout (`CausalLM.tied_head`), `model.embed_tokens`
    reads its rows there and the plain embedding is dropped. Returns whether it did."""
    inner, head = getattr(model, "model", None), getattr(model, "tied_head", None)
    embedding = getattr(inner, "embed_tokens", None)
    if not isinstance(embedding, nn.Embedding) or not isinstance(head, torch.Tensor):
        return False
    if getattr(model, "tied_head_layout", None) is not DenseLayout.BLOCKED:  # as CausalLM recorded when it packed
        return False
    if embedding.weight.dtype != torch.bfloat16 or head.shape[0] != embedding.num_embeddings:  # not this table's
        return False
    inner.embed_tokens = BlockedRowEmbedding(head)
    return True


def embedding_from_head(model: nn.Module) -> None:
    """`model.embed_tokens` reads its rows from the LM head, which holds the tied embedding's GGUF blocks packed
    (the loader's choice, `keeps_tied_head`: the dense embedding is then never read from the file)."""
    inner, head = getattr(model, "model", None), getattr(model, "lm_head", None)
    embedding = getattr(inner, "embed_tokens", None)
    packed = getattr(head, "packed_int", None) or []
    if (not isinstance(embedding, nn.Embedding) or len(packed) != 1 or packed[0].bits not in ROW_BITS
            or (packed[0].rows, packed[0].cols) != tuple(embedding.weight.shape)):
        held = [(w.bits, w.rows, w.cols) for w in packed]
        raise ModelLoadError(f"the LM head was to keep the tied embedding's blocks for the embedding's rows, but holds "
                             f"{held or 'no packed weight'} (bits, rows, cols); load the model with "
                             f"--gguf-dequantize-at-load")
    inner.embed_tokens = PackedRowEmbedding(packed[0], embedding.weight.dtype)
