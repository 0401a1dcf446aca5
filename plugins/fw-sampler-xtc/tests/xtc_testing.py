"""Helpers for the XTC plugin's tests: the plugin importable from the checkout when it is not
installed, fw's sampler pipeline with the built-in samplers plus XTC (as the engine builds it),
and sequences with the per-row seeded generators the engine gives seeded requests."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

PLUGIN_ROOT = Path(__file__).resolve().parent.parent

try:  # the installed package, else the checkout (the tests run without installing the plugin)
    import fw_sampler_xtc  # noqa: F401
except ImportError:
    sys.path.insert(0, str(PLUGIN_ROOT))

from fw.sampling.batch import SamplingBatch  # noqa: E402
from fw.sampling.params import SamplingParams  # noqa: E402
from fw.testing import sampler_pipeline as fw_sampler_pipeline  # noqa: E402
from fw.testing import FakeSequence  # noqa: E402


def sampler_pipeline():
    """fw's SamplerPipeline over the built-in samplers and this plugin, loaded as entry points."""
    return fw_sampler_pipeline("xtc", "fw_sampler_xtc.plugin")


class FakeSeq(FakeSequence):
    """A row whose generator is seeded as the engine seeds a seeded request's (seed + output index)."""

    def __init__(self, params: SamplingParams, token_ids: list[int] = (1,), num_prompt_tokens: int = 1):
        generator = None if params.seed is None else torch.Generator().manual_seed(params.seed)
        super().__init__(params, list(token_ids), num_prompt_tokens, generator)


def step(pipeline, seqs: list[FakeSeq], logits: torch.Tensor) -> list[int]:
    """One sampling step over these sequences (their params admitted as the engine does)."""
    for s in seqs:
        pipeline.validate(s.params)
    batch = SamplingBatch(seqs, logits.shape[1], torch.device("cpu"), frozenset())
    return pipeline.sample(logits.clone(), batch).token_ids


def logits_for(probs: list[float]) -> torch.Tensor:
    """One row whose softmax is exactly these probabilities (they sum to 1)."""
    return torch.tensor([math.log(p) for p in probs], dtype=torch.float32)


def xtc(threshold: float, probability: float) -> list[dict]:
    return [{"name": "xtc", "threshold": threshold, "probability": probability}]
