"""Runs sampler plugins over a batch: the grammar mask (structured output), the
logits stages in order, then the chosen final-choice sampler, then
log-probabilities of the model's distribution (after the grammar mask, as in
vLLM: a token the grammar forbids has logprob -inf)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fw.engine.outputs import Logprob
from fw.errors import ConfigError
from fw.grammar.bitmask import apply_token_bitmask
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
    def sample(self, logits: torch.Tensor, batch: SamplingBatch,
               grammar_mask: tuple[torch.Tensor, list[int]] | None = None) -> SampleResult:
        """`grammar_mask`: (bitmask, rows) from `GrammarService.fill_bitmask`, applied to those rows
        before every stage."""
        # Inference mode like the forward pass that made `logits`: stages may edit them in place,
        # which torch forbids on inference tensors outside it.
        masked_rows = masked = None
        if grammar_mask is not None:
            bitmask, rows = grammar_mask
            masked_rows = torch.tensor(rows, dtype=torch.long, device=logits.device)
            apply_token_bitmask(logits, bitmask, masked_rows)
            masked = logits[masked_rows]  # a copy: stages may edit `logits` in place
        want_logprobs = [p.logprobs is not None for p in batch.params]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
        for stage in self.stages:
            if any(stage.is_active(p) for p in batch.params):
                logits = stage.apply(logits, batch)
        if masked_rows is not None:
            _revive_dead_rows(logits, masked_rows, masked, batch.eos_token_ids)
        tokens = self.chooser.choose(logits, batch)
        token_list = tokens.tolist()
        logprobs: list[dict[int, Logprob] | None] = [None] * len(batch)
        if raw_logprobs is not None:
            for i, p in enumerate(batch.params):
                if p.logprobs is not None:
                    logprobs[i] = token_logprobs(raw_logprobs[i], token_list[i], p.logprobs)
        return SampleResult(token_list, logprobs)


def _revive_dead_rows(logits: torch.Tensor, rows: torch.Tensor, masked: torch.Tensor,
                      eos_token_ids: frozenset[int]) -> None:
    """A grammar row that the stages left with no allowed token (min_tokens forbids the stop token
    that is all the grammar allows) falls back to the grammar's own mask; one the grammar itself
    left empty gets its stop tokens. Sampling an all -inf row would fail the whole batch's step."""
    dead = torch.isneginf(logits[rows]).all(dim=1)
    if not bool(dead.any()):
        return
    revived = masked[dead]
    empty = torch.isneginf(revived).all(dim=1)
    if bool(empty.any()) and eos_token_ids:
        stops = torch.tensor(sorted(eos_token_ids), dtype=torch.long, device=logits.device)
        revived[empty.nonzero().squeeze(1).unsqueeze(1), stops.unsqueeze(0)] = 0.0
    logits[rows[dead]] = revived


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
