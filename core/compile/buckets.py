"""Shape buckets: the finite set of shapes a compiled step is built for.

Why: torch.compile with static shapes builds one graph per input shape. A
server sees every token count from 1 to its step budget, so without bounds it
would compile while serving. A step's token count (and the number of rows it
samples) is padded up to the next bucket instead; warm-up compiles every
bucket once, and serving never compiles again.

Two dimensions, each with min/step/max (the flags `--bucket-tokens-*` and
`--bucket-batch-*`):

* tokens: the flat token count of one forward pass (decode tokens + prefill
  chunks), at most `--max-batch-input-tokens` by the scheduler's budget;
* batch: the rows whose logits a step computes (one per sampled sequence), at
  most `--max-batch-size`.

Schemes (`--bucketing`):

* exponential (default): min, 2*min, 4*min, ... and max itself; a bucket above
  `step` is rounded up to a multiple of `step`. Few buckets (12 for 1..2048),
  so few compilations, at up to 2x padding.
* linear: vLLM's Gaudi warm-up ranges: min, doubling up to `step`, then every
  `step` up to max. More buckets, at most `step` padded tokens.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from fw.config import BUCKETING
from fw.errors import ConfigError

SCHEMES = BUCKETING  # --bucketing

# Spacing of the linear scheme above its doubling ramp (and the rounding of large exponential buckets).
DEFAULT_BATCH_STEP = 8
DEFAULT_TOKENS_STEP = 256


def bucket_range(scheme: str, low: int, step: int, high: int) -> list[int]:
    """The sorted buckets from `low` to `high` (both included) under `scheme`."""
    if scheme not in SCHEMES:
        raise ConfigError(f"--bucketing must be one of {', '.join(SCHEMES)}; got {scheme!r}")
    if not 1 <= low <= high or step < 1:
        raise ConfigError(f"bucket range needs 1 <= min <= max and step >= 1; got min={low}, step={step}, max={high}")
    out: list[int] = []
    value = low
    while value < high:
        out.append(value)
        if scheme == "linear" and value >= step:
            value += step
        else:
            value *= 2
            if scheme == "linear" and value > step > out[-1]:
                value = step  # the ramp ends exactly at step
            elif scheme == "exponential" and value > step:
                value = -(-value // step) * step
    out.append(high)
    return sorted(set(out))


@dataclass(frozen=True)
class StepBuckets:
    tokens: tuple[int, ...]
    batch: tuple[int, ...]

    @classmethod
    def from_config(cls, config) -> "StepBuckets":
        """Buckets for an EngineConfig: unset bounds default to 1 and the scheduler's limits."""
        scheme = config.bucketing
        tokens_max = config.bucket_tokens_max or config.step_tokens
        batch_max = config.bucket_batch_max or config.max_batch_size
        tokens = bucket_range(scheme, config.bucket_tokens_min or 1, config.bucket_tokens_step or DEFAULT_TOKENS_STEP,
                              tokens_max)
        batch = bucket_range(scheme, config.bucket_batch_min or 1, config.bucket_batch_step or DEFAULT_BATCH_STEP,
                             batch_max)
        return cls(tuple(tokens), tuple(batch))

    @staticmethod
    def pick(buckets: tuple[int, ...], n: int) -> int | None:
        """The smallest bucket that holds `n`, or None when `n` is above the largest."""
        i = bisect.bisect_left(buckets, n)
        return buckets[i] if i < len(buckets) else None

    def token_bucket(self, n: int) -> int | None:
        return self.pick(self.tokens, n)

    def batch_bucket(self, n: int) -> int | None:
        return self.pick(self.batch, n)

    def as_dict(self) -> dict[str, list[int]]:
        return {"tokens": list(self.tokens), "batch": list(self.batch)}
