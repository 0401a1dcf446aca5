"""A sampler stage: tokens a request bans are never chosen.

Requests opt in through `SamplingParams.extra_args`, the field fw reserves for
third-party sampler options::

    SamplingParams(extra_args={"banned_token_ids": [13, 42]})

Stages see the whole batch; rows that ban nothing pass through unchanged."""

from __future__ import annotations

import torch

from fw.sampling.batch import SamplingBatch

EXTRA_ARG = "banned_token_ids"


def banned_ids(params) -> list[int]:
    """The request's banned ids as ints. A value that is not a list of integers is
    a request error, raised as TypeError rather than ignored."""
    raw = (params.extra_args or {}).get(EXTRA_ARG)
    if not raw:
        return []
    if isinstance(raw, (str, bytes)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
        raise TypeError(f"extra_args[{EXTRA_ARG!r}] must be a list of token ids (ints), got {raw!r}")
    return list(raw)


class BannedTokens:
    """Sets the logits of banned tokens to -inf, so no later stage or final choice can pick them.

    Ids outside the vocabulary cannot be generated anyway and are skipped."""

    def is_active(self, params) -> bool:
        return bool((params.extra_args or {}).get(EXTRA_ARG))

    def apply(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        # Build a mask and return a new tensor rather than writing into `logits`: the
        # engine may hand stages tensors it still uses (or inference-mode tensors).
        vocab = logits.shape[1]
        banned = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
        for row, params in enumerate(batch.params):
            ids = [t for t in banned_ids(params) if 0 <= t < vocab]
            if ids:
                banned[row, ids] = True
        return logits.masked_fill(banned, float("-inf"))
