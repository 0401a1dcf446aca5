"""A stand-in for an engine sequence, for testing samplers without an engine.

`fw.sampling.batch.SamplingBatch` reads only these attributes of each row, so a
sampler's tests (the conformance kit's, a plugin's own) build batches from
these instead of running the engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class FakeSequence:
    """Parameters, the tokens so far (prompt, then output) and the row's generator (a seeded
    request's, as the engine makes it), as `SamplingBatch` sees a sequence."""

    params: Any
    token_ids: list[int]
    num_prompt_tokens: int = 1
    generator: torch.Generator | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens
