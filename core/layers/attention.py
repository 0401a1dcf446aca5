"""The attention-backend contract, the per-step metadata, and the `Attention` layer.

Tokens of all sequences in a step are flattened into one dimension. Decode
sequences (one new token) come first, then prefill chunks. Each layer's KV
cache is paged: `kv_cache_shape` says its layout, `slot_mapping` where each new
token's K/V go, `block_tables` which pages hold each sequence's context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fw.kernels.step_program import NotReplayable, replays


@dataclass
class AttentionMetadata:
    """Batch layout shared by every attention layer in one forward step."""

    num_decodes: int  # the first num_decodes sequences have query_len == 1
    query_lens: list[int]  # new tokens per sequence in this step
    seq_lens: list[int]  # context length per sequence after this step (cached + new)
    query_start_loc: torch.Tensor  # [B + 1] offsets into the flat token dimension
    seq_lens_tensor: torch.Tensor  # [B] on device
    block_tables: torch.Tensor  # [B, max_blocks] page ids, padded with 0
    slot_mapping: torch.Tensor  # [T] flat slot (page * page_size + offset) for each new token
    page_size: int
    backend_state: Any = None  # whatever the backend's `prepare` returned for this step

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


class AttentionBackend:
    """Base class of attention backends; one instance per attention layer.

    Subclasses implement `forward`. `prepare` runs once per step (for all
    layers) to build whatever the backend needs from the metadata."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap

    @staticmethod
    def kv_cache_shape(num_blocks: int, page_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """Layout of one layer's cache; default [2 (K, V), pages, page_size, kv heads, head dim]."""
        return (2, num_blocks, page_size, num_kv_heads, head_dim)

    @classmethod
    def prepare(cls, meta: AttentionMetadata) -> Any:
        return None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D]. Store k, v in the cache, return [T, H, D]."""
        raise NotImplementedError

    # A backend whose `forward` a step program can replay (fw.layers.replay) names the per-step tensors its
    # calls read (`step_inputs` returns them in that order) and records its calls in `emit_step`.
    step_input_names: tuple[str, ...] = ()

    @classmethod
    def step_inputs(cls, meta: AttentionMetadata) -> tuple[torch.Tensor, ...]:
        return ()

    def emit_step(self, b, q, k, v, kv_cache: torch.Tensor):
        """`forward` as a step program's calls on registers q, k, v ([T, H, D] and [T, Hkv, D] views); returns
        the output register [T, H, D]. The default: this backend is not replayed."""
        raise NotReplayable(f"attention backend {type(self).__name__} has no step program")


class Attention(nn.Module):
    """The layer architectures use: owns a backend instance and its KV cache."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        ctx,
        scale: float | None = None,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.impl: AttentionBackend = ctx.attention_backend(
            num_heads, num_kv_heads, head_dim, scale if scale is not None else head_dim**-0.5,
            sliding_window=sliding_window, logit_softcap=logit_softcap,
        )
        self.kv_cache: torch.Tensor | None = None  # bound by the model runner

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = q.shape[0]
        out = self.impl.forward(
            q.view(t, self.num_heads, self.head_dim),
            k.view(t, self.num_kv_heads, self.head_dim),
            v.view(t, self.num_kv_heads, self.head_dim),
            self.kv_cache,
            meta,
        )
        return out.reshape(t, self.num_heads * self.head_dim)

    def emit_step(self, b, q, k, v):
        """`forward` as a step program's calls (fw.layers.replay); q, k, v are [T, N * D] registers."""
        replays(self, Attention)
        out = self.impl.emit_step(b, b.view(q, self.num_heads, self.head_dim),
                                  b.view(k, self.num_kv_heads, self.head_dim),
                                  b.view(v, self.num_kv_heads, self.head_dim), self.kv_cache)
        return b.view(out, self.num_heads * self.head_dim)
