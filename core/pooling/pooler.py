"""Hidden states -> one vector per sequence, and the vector -> the embedding a caller gets.

Two shapes of input: a whole step of packed sequences (the encoder engine: every sequence complete
in one forward), and a sequence's prompt arriving in chunks (a decoder's chunked prefill through
the scheduler), which `PoolingState` folds in as it comes. Both pool in float32."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fw.pooling.config import PoolingConfig
from fw.pooling.params import PoolingParams


def pool_packed(hidden: torch.Tensor, method: str, cu_seqlens: torch.Tensor, seq_index: torch.Tensor,
                seq_lens: list[int]) -> torch.Tensor:
    """[T, H] packed token states of B whole sequences -> [B, H] float32."""
    b = len(seq_lens)
    if method == "cls":
        return hidden.index_select(0, cu_seqlens[:-1]).float()
    if method == "last":
        return hidden.index_select(0, cu_seqlens[1:] - 1).float()
    h = hidden.float()
    if method == "max":
        out = torch.empty(b, h.shape[1], device=h.device)
        return out.scatter_reduce_(0, seq_index[:, None].expand_as(h), h, "amax", include_self=False)
    sums = torch.zeros(b, h.shape[1], device=h.device).index_add_(0, seq_index, h)
    lens = torch.tensor(seq_lens, dtype=torch.float32, device=h.device)[:, None]
    return sums / (lens.sqrt() if method == "mean_sqrt_len" else lens)


class PoolingState:
    """One embedding request on a decoder: its params, and its pooled state while its prompt is computed
    chunk by chunk. A chunk starting at position 0 starts over (a preempted sequence recomputes its
    prompt from the start)."""

    def __init__(self, method: str, params: PoolingParams):
        self.method = method
        self.params = params
        self.value: torch.Tensor | None = None

    def add(self, first: int, rows: torch.Tensor) -> None:
        """`rows` [k, H]: the states of positions first .. first + k - 1."""
        if first == 0:
            self.value = None
        if self.method == "cls":
            if first == 0:
                self.value = rows[0].float()
        elif self.method == "last":
            self.value = rows[-1].float()
        elif self.method == "max":
            top = rows.float().amax(0)
            self.value = top if self.value is None else torch.maximum(self.value, top)
        else:
            total = rows.float().sum(0)
            self.value = total if self.value is None else self.value + total

    def result(self, num_tokens: int) -> torch.Tensor:
        if self.method == "mean":
            return self.value / num_tokens
        if self.method == "mean_sqrt_len":
            return self.value / math.sqrt(num_tokens)
        return self.value


def finish(vectors: torch.Tensor, config: PoolingConfig, dimensions: list[int | None]) -> list[torch.Tensor]:
    """[B, H] pooled vectors -> each request's embedding on the CPU: cut to its `dimensions` (Matryoshka),
    then normalised when the model's embeddings are."""
    vectors = vectors.float().cpu()
    if all(d is None for d in dimensions):
        return list(F.normalize(vectors, dim=-1) if config.normalize else vectors)
    out = []
    for row, dims in zip(vectors, dimensions):
        if dims is not None:
            row = row[:dims]
        out.append(F.normalize(row, dim=-1) if config.normalize else row)
    return out
