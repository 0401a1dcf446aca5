"""The engine's side of speculative decoding: the proposer `--speculative-config` names, which sequences
draft in a step and how many tokens, and what was accepted (docs/speculative.md).

`Speculator.propose(running)` runs before each step's scheduling and sets `seq.draft_token_ids` (and
`seq.draft_probs`) on the sequences that speculate; the scheduler gives each 1 + len(draft) tokens, the
model runner returns logits at all of them, and the engine verifies (fw.speculative.rejection), then calls
`record`. Speculation is skipped, per step or per sequence, where it would only cost:

- a step whose running batch has `disable_by_batch_size` sequences or more: a large batch is compute-bound,
  and verifying k + 1 tokens per sequence costs about k + 1 times a decode;
- a sequence whose recent drafts were mostly rejected (an exponential average of accepted / proposed below
  `min_acceptance_rate`): it pauses for a number of its decode steps that doubles with each pause in a row;
- a request with `SamplingParams.speculative = False`, and one close to `max_tokens` or the maximum length
  (the draft is cut to what could still be emitted).

With `adaptive_k` (the default) each sequence drafts the k that its recent acceptance makes pay best
(`best_k`): all k while nearly every draft token is kept, fewer as more are rejected.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import Any

from fw.errors import ConfigError, InvalidRequestError, UnknownImplementationError
from fw.speculative.config import FLAG, REQUEST_PARAM, SpeculativeConfig
from fw.speculative.contract import Draft, DraftRequest, ProposerContext

logger = logging.getLogger("fw.speculative")

PAUSE_MIN, PAUSE_MAX = 4, 64  # decode steps a sequence with poor acceptance stops drafting for
EMA_WEIGHT = 0.5  # weight of the newest draft in a sequence's acceptance average
# adaptive k: a verify pass's cost per draft token, in one-token decode steps (measured in
# docs/speculative.md), how fast old drafts are forgotten, and what a new sequence is assumed to accept
# (3 draft tokens of 4 tried)
DRAFT_TOKEN_COST = 0.1
ADAPT_DECAY = 0.8
PRIOR_ACCEPTED, PRIOR_TRIED = 3.0, 4.0


def best_k(alpha: float, k_max: int, cost: float = DRAFT_TOKEN_COST) -> int:
    """The draft length that emits the most tokens per unit of verify cost. With each draft token accepted
    with probability `alpha` given the ones before it, a draft of k emits (1 - alpha^(k+1)) / (1 - alpha)
    tokens on average (the accepted ones and the one after) and its verify pass costs 1 + cost * k decodes."""
    best, best_value = 1, 0.0
    for k in range(1, k_max + 1):
        tokens = k + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
        value = tokens / (1.0 + cost * k)
        if value > best_value + 1e-9:
            best, best_value = k, value
    return best


@dataclass
class SpeculationState:
    """One sequence's drafts: its counters and its acceptance-based pause."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    recent_rate: float = 1.0
    paused_steps: int = 0
    next_pause: int = PAUSE_MIN
    # adaptive k: draft tokens accepted and tried (up to and including the first rejected one), decayed
    accepted_weight: float = PRIOR_ACCEPTED
    tried_weight: float = PRIOR_TRIED

    @property
    def acceptance(self) -> float:
        """The chance that a draft token is accepted, given the ones before it were."""
        return self.accepted_weight / self.tried_weight


@dataclass
class SpeculationStats:
    num_drafts: int = 0  # verify passes of one sequence's draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [j]: drafts whose token j was accepted
    num_steps_disabled_by_batch: int = 0
    num_pauses: int = 0  # times a sequence paused for low acceptance

    def as_dict(self) -> dict[str, Any]:
        drafts = self.num_drafts
        return {
            "spec_num_drafts": drafts,
            "spec_num_draft_tokens": self.num_draft_tokens,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
            # tokens emitted per verify pass of a sequence: 1 + accepted / drafts (vLLM's mean acceptance length)
            "spec_mean_acceptance_length": 1.0 + self.num_accepted_tokens / drafts if drafts else 0.0,
            "spec_acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0,
            "spec_accepted_per_position": list(self.accepted_per_position),
            "spec_num_steps_disabled_by_batch": self.num_steps_disabled_by_batch,
            "spec_num_pauses": self.num_pauses,
        }


def checked_args(spec: Any, args: dict[str, Any]) -> dict[str, Any]:
    """The method's keys of the configuration checked against the spec's schema, with its defaults."""
    if spec.parameters is None:
        if args:
            raise ConfigError(f"{FLAG}: method {spec.name!r} takes no options besides the common ones; got "
                              f"{', '.join(sorted(args))}")
        return {}
    import jsonschema  # only an engine that speculates pays for the import

    cls = jsonschema.validators.validator_for(spec.parameters, default=jsonschema.Draft202012Validator)
    error = jsonschema.exceptions.best_match(cls(spec.parameters).iter_errors(args))
    if error is not None:
        at = ".".join(str(p) for p in error.absolute_path)
        raise ConfigError(f"{FLAG}: {spec.name}: {at + ': ' if at else ''}{error.message}")
    out = copy.deepcopy(args)
    for key, prop in spec.parameters.get("properties", {}).items():
        if isinstance(prop, dict) and "default" in prop and key not in out:
            out[key] = copy.deepcopy(prop["default"])
    return out


class Speculator:
    """Made when the engine starts, before the model loads (a bad method or option fails first); `start`
    builds the proposer once the model's vocabulary and device are known."""

    def __init__(self, config: SpeculativeConfig, registry):
        self.config = config
        try:
            spec = registry.get(config.method)
        except UnknownImplementationError as exc:
            raise UnknownImplementationError(f"{FLAG}: method {config.method!r}: {exc}") from None
        self.spec = spec
        self.registered = sorted(registry.names())
        self.args = checked_args(spec, config.args)
        self.proposer = None
        self.vocab_size = 0
        self.stats = SpeculationStats(accepted_per_position=[0] * config.num_speculative_tokens)
        self._warned: set[str] = set()

    def start(self, context: ProposerContext) -> None:
        self.vocab_size = context.vocab_size
        try:
            self.proposer = self.spec.factory(self.args, context)
        except (ValueError, TypeError) as exc:  # a factory's own checks of its options
            raise ConfigError(f"{FLAG}: {self.spec.name}: {exc}") from None

    def check_request(self, params) -> None:
        """A request's `speculative_config` against this engine: the method and draft model it names (if
        any) must be the engine's, and its k at most the engine's."""
        wanted = params.speculative_config
        if not wanted:
            return
        method = wanted.get("method", self.config.method)
        if method != self.config.method:
            known = (f"no proposer is named {method!r} (registered: {', '.join(self.registered)})"
                     if method not in self.registered else f"{method!r} is installed")
            raise InvalidRequestError(
                f"{REQUEST_PARAM}: method {method!r}: {known}, and this engine speculates with "
                f"{self.config.method!r}; a request cannot switch proposers (drop method, or start an engine "
                f"with {FLAG} naming it)", param=REQUEST_PARAM)
        model, mine = wanted.get("model"), self.args.get("model")
        if model is not None and model != mine:
            has = f"this engine's draft model is {mine!r}" if mine else \
                f"method {self.config.method!r} uses no draft model"
            raise InvalidRequestError(f"{REQUEST_PARAM}: model {model!r}: {has}; a request cannot switch drafts "
                                      f"(drop model)", param=REQUEST_PARAM)
        k = wanted.get("num_speculative_tokens")
        if k is not None and k > self.config.num_speculative_tokens:
            raise InvalidRequestError(
                f"{REQUEST_PARAM}: num_speculative_tokens {k} is above this engine's "
                f"{self.config.num_speculative_tokens} ({FLAG}); give 1 to {self.config.num_speculative_tokens}",
                param=REQUEST_PARAM)

    def propose(self, running: list, max_length: int) -> None:
        """Set the drafts of this step (cleared on every running sequence first)."""
        for seq in running:
            if seq.draft_token_ids:
                seq.draft_token_ids, seq.draft_probs = [], None
        if len(running) >= self.config.disable_by_batch_size:
            self.stats.num_steps_disabled_by_batch += 1
            return
        seqs, requests = [], []
        for seq in running:
            if seq.num_computed_tokens != seq.num_tokens - 1 or not seq.params.speculative:
                continue  # still prefilling (or recomputing), or opted out
            state = seq.speculation
            if state is None:
                state = seq.speculation = SpeculationState()
            if state.paused_steps > 0:
                state.paused_steps -= 1
                continue
            wanted = seq.params.speculative_config
            k = min((wanted or {}).get("num_speculative_tokens") or self.config.num_speculative_tokens,
                    seq.params.max_tokens - seq.num_output_tokens - 1, max_length - seq.num_tokens - 1)
            if self.config.adaptive_k and k > 1:
                k = best_k(state.acceptance, k)
            if k < 1:
                continue
            seqs.append(seq)
            requests.append(DraftRequest(seq.seq_id, seq.token_ids, seq.num_prompt_tokens, k, seq.params))
        if not requests:
            return
        drafts = self.proposer.propose(requests)
        if len(drafts) != len(requests):
            raise RuntimeError(f"proposer {self.spec.name!r} answered {len(drafts)} drafts for "
                               f"{len(requests)} requests")
        for seq, request, draft in zip(seqs, requests, drafts):
            ids, probs = self._checked(draft, request.max_tokens)
            if ids:
                seq.draft_token_ids, seq.draft_probs = ids, probs

    def _checked(self, draft: Draft | None, limit: int) -> tuple[list[int], Any]:
        """The usable part of a draft: at most `limit` ids, up to the first outside the vocabulary."""
        if draft is None or not draft.token_ids:
            return [], None
        ids = []
        for t in list(draft.token_ids)[:limit]:
            t = int(t)
            if not 0 <= t < self.vocab_size:
                self._warn("vocab", f"proposer {self.spec.name!r} proposed token id {t}, outside the vocabulary "
                                    f"(0..{self.vocab_size - 1}); its draft is cut there")
                break
            ids.append(t)
        probs = draft.probs
        if probs is not None and ids:
            if probs.dim() != 2 or probs.shape[0] < len(ids) or probs.shape[1] != self.vocab_size:
                self._warn("probs", f"proposer {self.spec.name!r} gave draft probabilities of shape "
                                    f"{tuple(probs.shape)}; expected [{len(ids)}, {self.vocab_size}]: draft dropped")
                return [], None
            probs = probs[:len(ids)].float()
        return ids, probs

    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("%s", message)

    def record(self, seq, num_draft: int, num_accepted: int) -> None:
        """A verify pass of `seq`'s draft of `num_draft` tokens kept `num_accepted` of them."""
        stats, state = self.stats, seq.speculation
        stats.num_drafts += 1
        stats.num_draft_tokens += num_draft
        stats.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            stats.accepted_per_position[j] += 1
        state.num_drafts += 1
        state.num_draft_tokens += num_draft
        state.num_accepted_tokens += num_accepted
        state.accepted_weight = ADAPT_DECAY * state.accepted_weight + num_accepted
        state.tried_weight = ADAPT_DECAY * state.tried_weight + num_accepted + (num_accepted < num_draft)
        rate = num_accepted / num_draft
        state.recent_rate = (1 - EMA_WEIGHT) * state.recent_rate + EMA_WEIGHT * rate
        if rate >= 0.5:
            state.next_pause = PAUSE_MIN
        if state.recent_rate < self.config.min_acceptance_rate:
            state.paused_steps = state.next_pause
            state.next_pause = min(2 * state.next_pause, PAUSE_MAX)
            state.recent_rate = 1.0  # after the pause, a few drafts decide again
            stats.num_pauses += 1

    def release(self, seq) -> None:
        if seq.speculation is not None:
            self.proposer.release(seq.seq_id)


__all__ = ["SpeculationState", "SpeculationStats", "Speculator", "best_k", "checked_args"]
