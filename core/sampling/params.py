"""`SamplingParams`: what a request asks of the sampler, validated up front."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from fw.errors import InvalidRequestError
from fw.grammar.constraint import StructuredOutputsParams
from fw.speculative.config import check_request_structure


@dataclass
class SamplingParams:
    """Per-request sampling settings, named as in vLLM and the OpenAI API.

    temperature 0 means greedy. `seed` makes a request reproducible whatever
    else shares its batch. `logprobs=N` returns, per generated token, the
    chosen token's log-probability plus the top N alternatives; `prompt_logprobs`
    does the same for prompt tokens. `extra_args` carries options for
    third-party sampler plugins. `structured_outputs` constrains the output to a JSON
    schema, regex, choice or grammar (a dict of the same fields is accepted).
    `samplers` names per-request sampler stages and their parameters,
    ``[{"name": "dry", "multiplier": 0.8}, "xtc"]`` (a bare name takes the defaults); the
    engine checks each against the sampler's declared schema. `allowed_token_ids`
    (vLLM's field) restricts every generated token to those ids. `speculative=False` opts the
    request out of speculative decoding when the engine runs with `--speculative-config` (its output
    is the same either way; speculation only changes how fast it comes); `speculative_config`, keys of
    that flag's object, tunes it for this request: `num_speculative_tokens` (at most the engine's),
    and `method` / `model`, which must name the engine's own when given.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    samplers: list[SamplerRequest | dict[str, Any] | str] | None = None  # SamplerRequests after __post_init__
    allowed_token_ids: list[int] | None = None
    extra_args: dict[str, Any] = field(default_factory=dict)
    speculative: bool = True
    speculative_config: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as exc:
                raise InvalidRequestError(f"structured_outputs: {exc}", param="structured_outputs") from None
        if self.top_k is None or self.top_k < 0:
            self.top_k = 0  # -1 and None mean "off", as in vLLM
        self.samplers = _sampler_requests(self.samplers)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _token_id_list(self.allowed_token_ids)
        self._validate()

    def _validate(self) -> None:
        def bad(param: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param} {why}", param=param)

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                     "presence_penalty"):
            if not math.isfinite(getattr(self, name)):  # JSON allows Infinity/NaN; no range check catches NaN
                raise bad(name, f"must be a finite number, got {getattr(self, name)}")
        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", f"must be at least 1, got {self.n}")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise bad("max_tokens", f"must be at least 0, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise bad("min_tokens", f"must be at least 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", f"must be between 0 and 100, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0.0:
            raise bad("repetition_penalty", f"must be positive, got {self.repetition_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", f"must be between -2 and 2, got {self.frequency_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", f"must be between -2 and 2, got {self.presence_penalty}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            # torch's generators take 64-bit seeds; a larger one failed deep in add_request.
            raise bad("seed", f"must fit in 64 bits (-2**63 .. 2**63-1), got {self.seed}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 20:
                raise bad(name, f"must be between 0 and 20, got {value}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if self.speculative_config is not None:
            check_request_structure(self.speculative_config)
        if self.logit_bias:
            for token, bias in self.logit_bias.items():
                if not -100.0 <= float(bias) <= 100.0:
                    raise bad("logit_bias", f"value for token {token} must be between -100 and 100, got {bias}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def sampler(self, name: str) -> SamplerRequest | None:
        """The request's entry for the per-request sampler `name`, or None when it does not name it."""
        for request in self.samplers:
            if request.name == name:
                return request
        return None


@dataclass
class SamplerRequest:
    """One per-request sampler stage a request names, with its parameters as given (`args`).

    `prepared` holds what each engine's stage made of them at admission (the schema's defaults
    filled in, then the stage's optional `prepare`), keyed by the stage object's id, so the work
    is done once per request rather than once per step."""

    name: str
    args: dict[str, Any] = field(default_factory=dict)
    prepared: dict[int, Any] = field(default_factory=dict, repr=False, compare=False)


def _sampler_requests(raw: Any) -> list[SamplerRequest]:
    """`samplers` as SamplerRequests: from dicts ({"name": ..., parameters...}), bare names or
    SamplerRequests. Whether a name and its parameters are known is the engine's check."""
    if raw is None:
        return []
    if isinstance(raw, (str, dict)) or not isinstance(raw, (list, tuple)):
        raise InvalidRequestError(
            'samplers must be a list such as [{"name": "dry", "multiplier": 0.8}], got '
            f"{type(raw).__name__}", param="samplers")
    out: list[SamplerRequest] = []
    for i, item in enumerate(raw):
        if isinstance(item, str):
            item = SamplerRequest(item)
        elif isinstance(item, dict):
            args = dict(item)
            name = args.pop("name", None)
            if not isinstance(name, str):
                raise InvalidRequestError(f'samplers[{i}] needs a "name" (a string naming the sampler), '
                                          f"got {name!r}", param="samplers")
            item = SamplerRequest(name, args)
        elif not isinstance(item, SamplerRequest):
            raise InvalidRequestError(f'samplers[{i}] must be an object with a "name" or a sampler name, '
                                      f"got {type(item).__name__}", param="samplers")
        if not item.name:
            raise InvalidRequestError(f"samplers[{i}]: the sampler name is empty", param="samplers")
        if any(o.name == item.name for o in out):
            raise InvalidRequestError(f"samplers: {item.name!r} is named twice; give each sampler once, "
                                      "with all its parameters", param="samplers")
        out.append(item)
    return out


def _token_id_list(raw: Any) -> list[int]:
    """allowed_token_ids as a non-empty list of ints (whether they are in the vocabulary is the engine's check)."""
    if isinstance(raw, (str, bytes, dict)) or not isinstance(raw, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in raw):
        raise InvalidRequestError(f"allowed_token_ids must be a list of token ids (integers), got {raw!r}",
                                  param="allowed_token_ids")
    if not raw:
        raise InvalidRequestError("allowed_token_ids is empty, which would allow no token; leave it out to "
                                  "allow every token", param="allowed_token_ids")
    return list(raw)
