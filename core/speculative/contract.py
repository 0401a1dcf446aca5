"""The proposer contract: what a `ProposerSpec.factory` returns (speculative decoding; docs/speculative.md).

`factory(args: dict, context: ProposerContext)` -> a `Proposer`, made once per engine when
`--speculative-config` names the spec's method. `args` are the method's own keys of that configuration
(ngram's `prompt_lookup_min` / `prompt_lookup_max`, a draft model's `model`), checked against the spec's
`parameters` JSON schema, with the schema's top-level defaults filled in.

Every engine step, before scheduling, the engine asks the proposer for drafts of the running sequences that
are ready to decode and speculating, one `DraftRequest` each, in one call. The proposer answers each with a
`Draft` of at most `request.max_tokens` token ids, or None (or an empty draft) for no proposal. The target
model verifies the drafts in its next forward pass, and the rejection rule keeps the output distribution
exactly the target's whatever the drafts are: a poor proposer costs speed, never correctness.

A deterministic proposer (n-gram lookup, a greedy draft model) leaves `Draft.probs` None: each draft token
is a point mass. A proposer that samples its drafts gives, per draft token, the distribution it drew it from
(`probs`, [len(token_ids), vocab_size] float32 rows summing to 1), which the rejection rule needs.

Proposers are called from the engine's thread only. A proposer that keeps state per sequence (a draft
model's KV cache) keys it by `DraftRequest.seq_id`, reads what was accepted from `token_ids` at the next
call (anything after the tokens it proposed from may have changed), and frees it in `release`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence, runtime_checkable


@dataclass(frozen=True)
class ProposerContext:
    """What a proposer is built with. `engine_config` (an `fw.config.EngineConfig`) and `plugins` (the
    engine's plugin manager, through which the draft_model proposer loads its model) are provisional:
    their attributes are not part of the stable plugin API."""

    vocab_size: int
    eos_token_ids: frozenset[int]
    num_speculative_tokens: int  # the most draft tokens any request asks for
    device: Any = None  # torch.device the target runs on
    tokenizer: Any = None
    engine_config: Any = None
    plugins: Any = None


@dataclass(frozen=True)
class DraftRequest:
    """One sequence to draft for. `token_ids` is the sequence's tokens so far, prompt then output (the
    engine's own list: read it, do not modify it); the last one has been sampled but not yet run through
    the target. `max_tokens` (1 or more) is the most draft tokens this step can use: the configured
    `num_speculative_tokens`, less near `max_tokens` or the maximum length."""

    seq_id: int
    token_ids: Sequence[int]
    num_prompt_tokens: int
    max_tokens: int
    params: Any  # the request's fw.sampling.SamplingParams


@dataclass(frozen=True)
class Draft:
    """Proposed continuation of one sequence: `token_ids`, and for a proposer that samples its drafts the
    distribution each was drawn from (`probs`: a float32 tensor [len(token_ids), vocab_size]); None for a
    deterministic proposer."""

    token_ids: list[int]
    probs: Any = None


@runtime_checkable
class Proposer(Protocol):
    """Proposes draft tokens for running sequences (see the module docstring)."""

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft | None]:
        """One answer per request, in order: a `Draft` (at most `max_tokens` ids) or None."""

    def release(self, seq_id: int) -> None:
        """The sequence finished or was aborted: forget what is kept for it (nothing, for a stateless one)."""


__all__ = ["Draft", "DraftRequest", "Proposer", "ProposerContext"]
