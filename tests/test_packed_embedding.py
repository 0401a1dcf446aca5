"""An embedding read from its tied LM head's blocked bf16 layout (fw.layers.packed_embedding): the rows are the
embedding's exactly, and a tied bf16 model on the CPU keeps one copy of the vocabulary matrix, not two."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from conftest import make_llm
from fw import SamplingParams
from fw.kernels.dense import bf16_kernel_ready, blocked_rows, pack_dense_weight
from fw.layers.packed_embedding import BlockedRowEmbedding

needs_kernel = pytest.mark.skipif(not bf16_kernel_ready(), reason="no AVX512-BF16 CPU or no C++ toolchain")


@needs_kernel
@pytest.mark.parametrize("rows, cols", [(96, 64), (100, 64), (47, 32), (1000, 576)])
def test_blocked_rows_are_the_weight_rows(rows, cols):
    """Whole blocks of 48 rows and a shorter last one (100 = 2 x 48 + 4; 47: only the short one)."""
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(rows, cols, generator=gen).bfloat16()
    packed = pack_dense_weight(w, "cpu")
    ids = torch.randint(0, rows, (2, 37), generator=gen)
    assert torch.equal(blocked_rows(packed, ids.reshape(-1)), w[ids.reshape(-1)])
    assert torch.equal(blocked_rows(packed, torch.arange(rows)), w)
    assert torch.equal(BlockedRowEmbedding(packed)(ids), w[ids])
    assert torch.equal(blocked_rows(packed, ids.reshape(-1).int()), w[ids.reshape(-1)])
    assert blocked_rows(packed, torch.tensor([], dtype=torch.long)).shape == (0, cols)
    with pytest.raises(RuntimeError, match=f"row {rows} is outside the weight's {rows} rows"):
        blocked_rows(packed, torch.tensor([0, rows]))


@needs_kernel
def test_a_tied_bf16_model_reads_its_embedding_from_the_packed_head(gqa_dir):
    llm = make_llm(gqa_dir, dtype="bfloat16")
    model = llm.engine.loaded.model
    embedding = model.model.embed_tokens
    assert isinstance(embedding, BlockedRowEmbedding) and embedding.packed.data_ptr() == model.tied_head.data_ptr()
    want = load_file(str(gqa_dir / "model.safetensors"))["model.embed_tokens.weight"].bfloat16()
    ids = torch.arange(want.shape[0]).view(4, -1)
    assert torch.equal(embedding(ids), want[ids])
    # one vocabulary matrix: no plain nn.Embedding (or other tensor of its size) beside the packed head
    assert not any(isinstance(m, torch.nn.Embedding) for m in model.modules())
    assert [p.data_ptr() for p in model.parameters() if p.numel() == want.numel()] == [embedding.packed.data_ptr()]
    out = llm.generate(["Hello world"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
