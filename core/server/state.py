"""What every route needs: the engine, the served names, limits and metrics.

Admission control lives here: a request over `--max-concurrent-requests` (or
one arriving while `--max-queue-size` requests wait) is refused with 429
before it touches the engine, as TGI does."""

from __future__ import annotations

import json
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import AsyncIterator, Iterator

from fw.engine.outputs import RequestOutput
from fw.errors import FwError
from fw.lora.request import LoRARequest
from fw.plugins.manager import PluginManager
from fw.sampling.params import SamplingParams
from fw.server.async_engine import AsyncEngine, RequestStream
from fw.server.config import ServerConfig
from fw.server.logtext import quoted_all
from fw.server.metrics import ServerMetrics
from fw.server.prompts import PromptLimits

logger = logging.getLogger("fw.server")


class OverloadedError(FwError):
    status_code = 429
    error_type = "rate_limit_error"


class ModelNotFoundError(FwError):
    status_code = 404
    error_type = "not_found_error"


class ShuttingDownError(FwError):
    status_code = 503
    error_type = "service_unavailable"


@dataclass
class ServerState:
    engine: AsyncEngine
    config: ServerConfig
    served_names: list[str]
    metrics: ServerMetrics
    in_flight: int = 0
    draining: bool = False
    started: float = field(default_factory=time.time)

    # The engine as routes see it: one facade, so no route reaches through the async wrapper into the engine.

    @property
    def tokenizer(self):
        return self.engine.engine.tokenizer

    @property
    def max_length(self) -> int:
        return self.engine.engine.max_length

    @property
    def vocab_size(self) -> int:
        return self.engine.engine.vocab_size

    @property
    def architecture_task(self) -> str:
        """What the served architecture was built for: "generate", or "embed" for an encoder."""
        return self.engine.engine.loaded.architecture.task

    @property
    def pooling(self):
        """How the served model pools into embeddings (fw.pooling); None when it generates."""
        return getattr(self.engine.engine, "pooling", None)

    @property
    def engine_config(self):
        """The engine's EngineConfig (fw.config): the flags the model was served with."""
        return self.engine.engine.config

    @property
    def lora(self):
        """The engine's LoRA adapters (fw.lora.LoRAManager); None without --enable-lora."""
        return getattr(self.engine.engine, "lora", None)

    @property
    def degraded(self) -> str | None:
        """Why some data-parallel replicas are lost, while others still serve; None when all are up."""
        return getattr(self.engine.engine, "degraded", None)

    @property
    def plugins(self) -> PluginManager:
        return self.engine.engine.plugins

    @property
    def max_input_tokens(self) -> int:
        return self.config.max_input_tokens or self.max_length - 1

    def model_name(self, requested: str | None) -> str:
        """The served name or loaded LoRA adapter a request names (404 for any other)."""
        if requested is None or requested in self.served_names:
            return requested or self.served_names[0]
        adapters = self.lora_adapters()
        if requested in adapters:
            return requested
        raise ModelNotFoundError(
            f"The model `{requested}` does not exist; this server serves {', '.join(self.served_names)}"
            + (f" and the LoRA adapters {', '.join(adapters)}" if adapters else ""))

    def lora_adapters(self) -> list[str]:
        """The LoRA adapters loaded in the engine (--enable-lora; fw.lora), by name."""
        return list(self.lora.registered) if self.lora is not None else []

    def lora_request(self, model: str) -> LoRARequest | None:
        """A request's adapter: its `model` when that names a LoRA adapter rather than the base model."""
        return None if model in self.served_names else LoRARequest(model)

    def note_ignored(self, req) -> None:
        """Unknown fields are accepted for compatibility, but never silently: they are logged."""
        ignored = req.ignored_fields()
        if ignored:
            logger.warning("ignored request fields: %s", quoted_all(ignored))

    @contextmanager
    def admission(self) -> Iterator["Permit"]:
        """Admit a request before its expensive work (rendering, tokenizing), as TGI takes its permit
        first: a server with every slot busy answers 429 at once, whatever the prompt's size. The
        permit is given back if the block raises; otherwise whoever answers gives it back."""
        permit = self.admit()
        try:
            yield permit
        except BaseException:
            permit.release()
            raise

    def admit(self) -> "Permit":
        if self.draining:
            raise ShuttingDownError("the server is shutting down; retry on another replica")
        if self.in_flight >= self.config.max_concurrent_requests:
            raise OverloadedError(
                f"Model is overloaded: {self.in_flight} requests in flight, the limit is "
                f"{self.config.max_concurrent_requests} (--max-concurrent-requests); retry later")
        limit = self.config.max_queue_size
        if limit is not None and self.engine.stats["num_waiting"] >= limit:
            raise OverloadedError(f"the queue is full ({limit} requests waiting, --max-queue-size); retry later")
        self.in_flight += 1
        return Permit(self)

    @cached_property
    def prompt_limits(self) -> PromptLimits:
        return PromptLimits(self.max_input_tokens, self.tokenizer)

    def check_prompt(self, num_tokens: int) -> None:
        self.prompt_limits.check_tokens(num_tokens)

    async def add(self, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
                  request_id: str, lora_request: LoRARequest | None = None) -> RequestStream:
        self.check_prompt(len(prompt_ids))
        if self.config.log_requests:
            logger.info("request %s: %d prompt tokens; %s", request_id, len(prompt_ids), describe_params(params))
        return await self.engine.add_request(prompt, prompt_ids, params, request_id, lora_request)

    async def track(self, stream: RequestStream, num_prompt_tokens: int) -> AsyncIterator[RequestOutput]:
        """A request's delta stream, with latency and token metrics recorded. Recorded in `finally`:
        a request cut short (client gone, shutdown) still counts, its unfinished choices as "abort"."""
        arrival = time.monotonic()
        last = None
        generated = 0
        # Every choice from the start: a client that leaves before the first token still counts
        # its choices as "abort" (it used to count nothing, so the abort went unrecorded).
        reasons: dict[int, str | None] = dict.fromkeys(range(stream.num_choices))
        labels = self.metrics.labels
        try:
            async for out in stream:
                now = time.monotonic()
                tokens = sum(len(c.token_ids) for c in out.outputs)
                if tokens:
                    if last is None:
                        self.metrics.ttft.labels(**labels).observe(now - arrival)
                    else:
                        for _ in range(tokens):
                            self.metrics.itl.labels(**labels).observe((now - last) / tokens)
                    last = now
                    generated += tokens
                for c in out.outputs:
                    reasons[c.index] = c.finish_reason or reasons.get(c.index)
                yield out
        finally:
            self.metrics.request_finished(list(reasons.values()), num_prompt_tokens, generated,
                                          time.monotonic() - arrival)


def describe_params(params: SamplingParams) -> str:
    """The sampling fields a request set (those off their defaults), for --log-requests. Values from the
    request are written as JSON (control characters escaped); a constraint by its kind, id tables by their size."""
    parts = []
    for f in fields(params):
        value = getattr(params, f.name)
        if value is None or value == [] or value == {} or value == f.default:
            continue
        if f.name == "samplers":
            value = json.dumps([{"name": s.name, **s.args} for s in value], default=str)
        elif f.name == "structured_outputs":
            value = next((k for k in ("json", "regex", "choice", "grammar") if getattr(value, k) is not None),
                         "json_object")
        elif f.name in ("logit_bias", "allowed_token_ids", "stop_token_ids"):
            value = f"{len(value)} entries"
        elif not isinstance(value, (bool, int, float)):
            value = json.dumps(value, default=str)
        parts.append(f"{f.name}={value}")
    return ", ".join(parts) or "defaults"


class Permit:
    """One admitted request's slot; releasing it twice gives back one slot, so every path that
    ends a request may release it without counting who did first."""

    def __init__(self, state: ServerState):
        self._state = state
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._state.in_flight -= 1
