"""Runs sampler plugins over a batch: logits stages in order, then the chosen
final-choice sampler, then log-probabilities of the model's distribution."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fw.engine.outputs import Logprob
from fw.errors import ConfigError
from fw.plugins.registry import Registry
from fw.sampling.batch import SamplingBatch


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob] | None]  # per row, when the row asked for them


class SamplerPipeline:
    def __init__(self, registry: Registry, choice: str):
        specs = list(registry)
        stage_specs = sorted((s for s in specs if s.role == "stage"), key=lambda s: s.order)
        self.stages = [s.factory() for s in stage_specs]
        self.stage_names = [s.name for s in stage_specs]
        choices = {s.name: s for s in specs if s.role == "choice"}
        if choice not in choices:
            raise ConfigError(
                f"--sampling-backend {choice!r} is not a registered final-choice sampler; "
                f"available: {', '.join(sorted(choices)) or '(none: is the built-in samplers plugin disabled?)'}"
            )
        self.chooser = choices[choice].factory()

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleResult:
        # Inference mode like the forward pass that made `logits`: stages may edit them in place,
        # which torch forbids on inference tensors outside it.
        want_logprobs = [p.logprobs is not None for p in batch.params]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
        for stage in self.stages:
            if any(stage.is_active(p) for p in batch.params):
                logits = stage.apply(logits, batch)
        tokens = self.chooser.choose(logits, batch)
        token_list = tokens.tolist()
        logprobs: list[dict[int, Logprob] | None] = [None] * len(batch)
        if raw_logprobs is not None:
            for i, p in enumerate(batch.params):
                if p.logprobs is not None:
                    logprobs[i] = token_logprobs(raw_logprobs[i], token_list[i], p.logprobs)
        return SampleResult(token_list, logprobs)


def token_logprobs(row: torch.Tensor, token: int, top_n: int) -> dict[int, Logprob]:
    """The chosen token's logprob and rank, plus the top-N alternatives (vLLM's shape)."""
    chosen = row[token]
    rank = int((row > chosen).sum().item()) + 1
    out = {token: Logprob(float(chosen), rank)}
    if top_n:
        values, ids = torch.topk(row, top_n)
        for r, (v, t) in enumerate(zip(values.tolist(), ids.tolist()), start=1):
            out.setdefault(t, Logprob(v, r))
    return out
