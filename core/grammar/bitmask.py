"""Packed token bitmasks (int32 words, bit j of word w = token 32w + j) and
their application to logits, in plain torch so the core needs no backend."""

from __future__ import annotations

import torch

_BITS = torch.arange(32, dtype=torch.int32)


def allocate_token_bitmask(rows: int, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[rows, ceil(vocab_size / 32)] int32, all tokens allowed (every bit set: -1)."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32, device=device)


def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, vocab_size] bool, True where allowed."""
    bits = _BITS.to(bitmask.device)
    return ((bitmask.unsqueeze(-1) >> bits) & 1).bool().reshape(bitmask.shape[0], -1)[:, :vocab_size]


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """Set forbidden tokens' logits to -inf, in place. `bitmask` has one row per logits row, or
    one per entry of `rows` (the logits rows it applies to)."""
    allowed = bitmask_to_bool(bitmask.to(logits.device), logits.shape[-1])
    if rows is None:
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        target = logits[rows]
        target.masked_fill_(~allowed, float("-inf"))
        logits[rows] = target
