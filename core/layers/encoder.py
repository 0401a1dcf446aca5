"""Bidirectional attention for encoder-only models (BERT and kin): no KV cache, every token of a
sequence sees every other token of the same sequence.

Tokens arrive packed flat, `[T, heads * head_dim]` for all sequences of a step, as in the decoder
path, so the linear layers never compute padding. Only attention pads: q, k and v are scattered
into a `[B, L]` grid (L the step's longest sequence), attended with torch's SDPA under a key mask,
and gathered back. `EncoderMetadata` holds the step's index tensors, built once and shared by
every layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class EncoderMetadata:
    """One encoder step: `seq_lens[i]` tokens of sequence i, packed in order."""

    seq_lens: list[int]
    cu_seqlens: torch.Tensor  # [B + 1] int64: where each sequence starts in the packed tokens, then T
    max_len: int
    seq_index: torch.Tensor  # [T] int64: the sequence each packed token belongs to
    pad_index: torch.Tensor  # [T] int64: each token's row in the flattened [B * max_len] grid
    key_mask: torch.Tensor | None  # [B, 1, 1, max_len] bool, True on real keys; None when no row is padded
    token_type_ids: torch.Tensor | None = None  # [T] int64 segment ids (sentence pairs); None: all 0

    @classmethod
    def build(cls, seq_lens: list[int], device: torch.device,
              token_type_ids: torch.Tensor | None = None) -> "EncoderMetadata":
        lens = torch.tensor(seq_lens, dtype=torch.long)
        cu = torch.zeros(len(seq_lens) + 1, dtype=torch.long)
        torch.cumsum(lens, 0, out=cu[1:])
        max_len = max(seq_lens)
        seq_index = torch.repeat_interleave(torch.arange(len(seq_lens)), lens)
        offsets = torch.arange(int(cu[-1])) - cu[seq_index]  # each token's position in its sequence
        pad_index = seq_index * max_len + offsets
        key_mask = None
        if min(seq_lens) != max_len:
            key_mask = (torch.arange(max_len)[None, :] < lens[:, None])[:, None, None, :]
        move = (lambda t: t.to(device)) if device.type != "cpu" else (lambda t: t)
        return cls(list(seq_lens), move(cu), max_len, move(seq_index), move(pad_index),
                   None if key_mask is None else move(key_mask),
                   None if token_type_ids is None else move(token_type_ids))

    @property
    def positions(self) -> torch.Tensor:
        """[T] each token's position inside its own sequence (0 at its first token)."""
        return self.pad_index - self.seq_index * self.max_len


class BidirectionalAttention(nn.Module):
    """softmax(q k^T * scale) v within each sequence, no causal mask, no cache.

    `forward(q, k, v, meta)` takes `[T, heads * head_dim]` tensors (views of a fused projection are fine)
    and returns `[T, heads * head_dim]`."""

    def __init__(self, num_heads: int, head_dim: int, scale: float | None = None):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.scale = scale if scale is not None else head_dim ** -0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: EncoderMetadata) -> torch.Tensor:
        b, length, h, d = len(meta.seq_lens), meta.max_len, self.num_heads, self.head_dim
        if b == 1:  # nothing to pad
            q, k, v = (x.reshape(1, -1, h, d).transpose(1, 2) for x in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v, scale=self.scale)
            return out.transpose(1, 2).reshape(-1, h * d)
        q, k, v = (self._padded(x, meta).view(b, length, h, d).transpose(1, 2) for x in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=meta.key_mask, scale=self.scale)
        return out.transpose(1, 2).reshape(b * length, h * d).index_select(0, meta.pad_index)

    @staticmethod
    def _padded(x: torch.Tensor, meta: EncoderMetadata) -> torch.Tensor:
        """[T, C] -> [B * max_len, C], each sequence's rows in its own block, zeros after them."""
        grid = x.new_zeros(len(meta.seq_lens) * meta.max_len, x.shape[-1])
        return grid.index_copy_(0, meta.pad_index, x)
