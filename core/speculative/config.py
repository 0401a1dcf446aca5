"""`--speculative-config`: the JSON object of vLLM's flag, read once into a `SpeculativeConfig`.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}

The keys fw reads itself are below (`CORE_KEYS`); every other key belongs to the method's proposer plugin
and is checked against its `ProposerSpec.parameters` schema when the engine starts. Import-light (no torch):
`EngineConfig` checks the structure here when it is built.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from fw.errors import ConfigError, InvalidRequestError

FLAG = "--speculative-config"
MAX_SPECULATIVE_TOKENS = 16

# key -> what it means (for error messages and docs/speculative.md)
CORE_KEYS = {
    "method": "the proposer plugin by name (ngram, or one a plugin registers)",
    "num_speculative_tokens": f"draft tokens per step, k (1 to {MAX_SPECULATIVE_TOKENS})",
    "disable_by_batch_size": "no speculation in a step whose running batch has at least this many sequences",
    "min_acceptance_rate": "a sequence whose recent drafts were accepted less often than this pauses speculating",
    "adaptive_k": "each sequence drafts the k (up to num_speculative_tokens) its recent acceptance makes pay best",
}
DEFAULT_DISABLE_BY_BATCH_SIZE = 8
DEFAULT_MIN_ACCEPTANCE_RATE = 0.2


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int = 4
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    min_acceptance_rate: float = DEFAULT_MIN_ACCEPTANCE_RATE
    adaptive_k: bool = True
    args: dict[str, Any] = field(default_factory=dict, hash=False)  # the method's own keys

    @classmethod
    def parse(cls, value: str | dict | None) -> "SpeculativeConfig | None":
        """The flag's value (JSON text or an already parsed mapping) -> a checked config; None when unset."""
        if value is None or (isinstance(value, str) and not value.strip()):
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ConfigError(f"{FLAG}: not JSON ({exc}); write e.g. "
                                  '\'{"method": "ngram", "num_speculative_tokens": 4}\'') from None
        if not isinstance(value, dict):
            raise ConfigError(f"{FLAG}: expected a JSON object, got {type(value).__name__}")
        raw = dict(value)
        method = raw.pop("method", None)
        if not isinstance(method, str) or not method:
            raise ConfigError(f'{FLAG}: "method" is required: the proposer by name, e.g. "ngram" '
                              "(`fw plugins list --kind proposer` lists them)")
        k = raw.pop("num_speculative_tokens", 4)
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"{FLAG}: num_speculative_tokens must be an integer from 1 to "
                              f"{MAX_SPECULATIVE_TOKENS}, got {k!r}")
        batch = raw.pop("disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE)
        if batch is None:
            batch = 1 << 30  # never
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ConfigError(f"{FLAG}: disable_by_batch_size must be a positive integer (or null: never), "
                              f"got {batch!r}")
        rate = raw.pop("min_acceptance_rate", DEFAULT_MIN_ACCEPTANCE_RATE)
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate <= 1.0:
            raise ConfigError(f"{FLAG}: min_acceptance_rate must be a number from 0 to 1, got {rate!r}")
        adaptive = raw.pop("adaptive_k", True)
        if not isinstance(adaptive, bool):
            raise ConfigError(f"{FLAG}: adaptive_k must be true or false, got {adaptive!r}")
        return cls(method, k, batch, float(rate), adaptive, raw)


# A request's `speculative_config` (SamplingParams): what one request may set, and what it means.
REQUEST_KEYS = {
    "num_speculative_tokens": "the most draft tokens per step for this request, 1 to the engine's",
    "method": "must be the engine's method (a request cannot switch proposers)",
    "model": "must be the engine's draft model (a request cannot switch drafts)",
}
REQUEST_PARAM = "speculative_config"


def check_request_structure(value: Any) -> None:
    """A request's `speculative_config` on its own (types, keys, k's range); what depends on the engine
    (its method, draft and k) is checked when the request is added (`Speculator.check_request`)."""
    def bad(why: str) -> InvalidRequestError:
        return InvalidRequestError(f"{REQUEST_PARAM}: {why}", param=REQUEST_PARAM)

    if not isinstance(value, dict):
        raise bad(f"expected an object such as {{\"num_speculative_tokens\": 2}}, got {type(value).__name__}")
    unknown = sorted(set(value) - set(REQUEST_KEYS))
    if unknown:
        raise bad(f"unknown key(s) {', '.join(map(repr, unknown))}; a request may set "
                  f"{', '.join(REQUEST_KEYS)} (the others are the engine's: {FLAG})")
    k = value.get("num_speculative_tokens")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS):
        raise bad(f"num_speculative_tokens must be an integer from 1 to {MAX_SPECULATIVE_TOKENS}, got {k!r}")
    for key in ("method", "model"):
        if key in value and (not isinstance(value[key], str) or not value[key]):
            raise bad(f"{key} must be a non-empty string, got {value[key]!r}")


__all__ = ["CORE_KEYS", "FLAG", "MAX_SPECULATIVE_TOKENS", "REQUEST_KEYS", "SpeculativeConfig",
           "check_request_structure"]
