"""Runs sampler plugins over a batch: the grammar mask (structured output), the
logits stages in order, then the chosen final-choice sampler, then
log-probabilities of the model's distribution (after the grammar mask, as in
vLLM: a token the grammar forbids has logprob -inf).

Per-request stages (`SamplerSpec.per_request`) run, in their place in the order, on just
the rows whose request names them, each with its own parameters; the other rows are not
touched. `validate` checks a request's named samplers against their schemas at admission."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import jsonschema
import torch

from fw.engine.outputs import Logprob
from fw.errors import ConfigError, InvalidRequestError
from fw.grammar.bitmask import apply_token_bitmask
from fw.plugins.registry import Registry
from fw.sampling.batch import SamplingBatch
from fw.sampling.params import SamplerRequest, SamplingParams


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob] | None]  # per row, when the row asked for them
    # [rows, V] log-softmax of the model's distribution (after the grammar mask), when a row asked for logprobs
    raw_logprobs: torch.Tensor | None = None
    # [len(keep_rows), V] the `keep_rows` rows' logits after every stage, as the final choice saw them
    processed: torch.Tensor | None = None


class SamplerPipeline:
    def __init__(self, registry: Registry, choice: str):
        specs = list(registry)
        stage_specs = sorted((s for s in specs if s.role == "stage"), key=lambda s: s.order)
        self.stages = [s.factory() for s in stage_specs]
        self.stage_names = [s.name for s in stage_specs]
        self.stage_specs = stage_specs
        self.per_request = {spec.name: (spec, stage) for spec, stage in zip(stage_specs, self.stages)
                            if spec.per_request}
        self._validators: dict[str, Any] = {}
        self._tokenizer = None  # the engine's, from `validate`: for stages prepared lazily
        choices = {s.name: s for s in specs if s.role == "choice"}
        if choice not in choices:
            raise ConfigError(
                f"--sampling-backend {choice!r} is not a registered final-choice sampler; "
                f"available: {', '.join(sorted(choices)) or '(none: is the built-in samplers plugin disabled?)'}"
            )
        self.chooser = choices[choice].factory()

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, batch: SamplingBatch,
               grammar_mask: tuple[torch.Tensor, list[int]] | None = None,
               keep_rows: list[int] | None = None) -> SampleResult:
        """`grammar_mask`: (bitmask, rows) from `GrammarService.fill_bitmask`, applied to those rows
        before every stage. `keep_rows`: rows whose fully processed logits to return too (speculative
        decoding verifies sampled drafts against them)."""
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
        for spec, stage in zip(self.stage_specs, self.stages):
            if spec.per_request:
                logits = self._apply_per_request(spec, stage, logits, batch)
            elif any(stage.is_active(p) for p in batch.params):
                logits = stage.apply(logits, batch)
        if masked_rows is not None:
            _revive_dead_rows(logits, masked_rows, masked, batch.eos_token_ids)
        processed = logits[torch.tensor(keep_rows, device=logits.device)] if keep_rows else None  # a copy
        tokens = self.chooser.choose(logits, batch)
        token_list = tokens.tolist()
        logprobs: list[dict[int, Logprob] | None] = [None] * len(batch)
        if raw_logprobs is not None:
            for i, p in enumerate(batch.params):
                if p.logprobs is not None:
                    logprobs[i] = token_logprobs(raw_logprobs[i], token_list[i], p.logprobs)
        return SampleResult(token_list, logprobs, raw_logprobs, processed)

    # -- per-request stages ----------------------------------------------------------------

    def validate(self, params: SamplingParams, tokenizer=None) -> None:
        """Refuse (InvalidRequestError, a 400) a request naming an unknown sampler or giving it
        parameters its schema rejects; otherwise prepare each named stage's parameters once. The
        engine calls it when a request is added, with its tokenizer (kept for later preparations)."""
        if tokenizer is not None:
            self._tokenizer = tokenizer
        for i, request in enumerate(params.samplers):
            entry = self.per_request.get(request.name)
            if entry is None:
                raise InvalidRequestError(self._unknown(request.name, i), param="samplers")
            self._prepare(*entry, request, tokenizer if tokenizer is not None else self._tokenizer)

    def _unknown(self, name: str, index: int) -> str:
        available = ", ".join(sorted(self.per_request)) or "none (install a sampler plugin such as fw-sampler-dry)"
        if name in self.stage_names:
            return (f"samplers[{index}]: {name!r} is a built-in stage set by its own request fields, not a "
                    f"per-request sampler; per-request samplers here: {available}")
        return f"samplers[{index}]: no per-request sampler named {name!r}; available: {available}"

    def _prepare(self, spec, stage, request: SamplerRequest, tokenizer) -> Any:
        args = self._checked_args(spec, request)
        prepare = getattr(stage, "prepare", None)
        if prepare is not None:
            try:
                args = prepare(args, tokenizer)
            except (ValueError, TypeError) as exc:
                raise InvalidRequestError(f"samplers: {spec.name}: {exc}", param="samplers") from None
        request.prepared[id(stage)] = args
        return args

    def _checked_args(self, spec, request: SamplerRequest) -> dict[str, Any]:
        """The request's parameters checked against the spec's schema, with its top-level defaults."""
        if spec.parameters is None:
            if request.args:
                raise InvalidRequestError(f"samplers: {spec.name} takes no parameters, got "
                                          f"{', '.join(sorted(request.args))}", param="samplers")
            return {}
        validator = self._validators.get(spec.name)
        if validator is None:
            cls = jsonschema.validators.validator_for(spec.parameters, default=jsonschema.Draft202012Validator)
            validator = self._validators[spec.name] = cls(spec.parameters)
        error = jsonschema.exceptions.best_match(validator.iter_errors(request.args))
        if error is not None:
            at = ".".join(str(p) for p in error.absolute_path)
            raise InvalidRequestError(f"samplers: {spec.name}: {at + ': ' if at else ''}{error.message}",
                                      param="samplers")
        args = copy.deepcopy(request.args)
        for key, prop in spec.parameters.get("properties", {}).items():
            if isinstance(prop, dict) and "default" in prop and key not in args:
                args[key] = copy.deepcopy(prop["default"])
        return args

    def _apply_per_request(self, spec, stage, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        rows, args = [], []
        for i, p in enumerate(batch.params):
            request = p.sampler(spec.name) if p.samplers else None
            if request is not None:
                rows.append(i)
                prepared = request.prepared.get(id(stage), _MISSING)
                if prepared is _MISSING:  # params that did not come through the engine's add_request
                    prepared = self._prepare(spec, stage, request, self._tokenizer)
                args.append(prepared)
        if not rows:
            return logits
        if len(rows) == len(batch):
            return stage.apply(logits, batch, args)
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        logits[index] = stage.apply(logits[index], batch.subset(rows), args)
        return logits


_MISSING = object()


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
