"""OpenAI wire format: request and response models (pydantic).

Unknown request fields are accepted and ignored, as vLLM does, so clients that
send newer OpenAI fields keep working; the server logs which it ignored.
Extra sampling fields vLLM clients send through `extra_body` (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, ...) are first-class.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fw.server.limits import CHAT_RANGES, RANGES, Range


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _text_is_unicode(cls, data: Any) -> Any:
        """JSON can escape lone surrogates ("\\ud800"), which are not text: the tokenizer raised
        a TypeError on them (a 500). Refuse them here as a bad request."""
        _check_text(data)
        return data

    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


def _check_text(data: Any) -> None:
    """Raise ValueError on a string (value or key) that UTF-8 cannot encode; iterative, as JSON
    may nest deeply."""
    stack = [data]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(f"the request has a string that is not valid Unicode (a lone surrogate "
                                 f"escape such as \\u{ord(value[exc.start]):04x}); send UTF-8 text") from None
        elif isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)


def _bounded(default: Any, name: str, ranges: dict[str, Range] = RANGES) -> Any:
    """A sampling field whose bounds (fw.server.limits) show in /openapi.json; the routes check
    them, so every out-of-range value gets the same message naming the field and its range."""
    return Field(default, json_schema_extra=ranges[name].schema())


class StreamOptions(BaseModel):
    include_usage: bool = False


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    json_schema: dict[str, Any] | None = None


class SamplingFields(_Request):
    """Sampling fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = _bounded(1, "n")
    temperature: float | None = _bounded(None, "temperature")
    top_p: float | None = _bounded(None, "top_p")
    stop: str | list[str] | None = None
    seed: int | None = _bounded(None, "seed")
    presence_penalty: float = _bounded(0.0, "presence_penalty")
    frequency_penalty: float = _bounded(0.0, "frequency_penalty")
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM-style extras (extra_body)
    top_k: int | None = _bounded(None, "top_k")
    min_p: float | None = _bounded(None, "min_p")
    repetition_penalty: float | None = _bounded(None, "repetition_penalty")
    min_tokens: int = _bounded(0, "min_tokens")
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # structured output: OpenAI's response_format, vLLM's guided_* and structured_outputs (extra_body)
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    structured_outputs: dict[str, Any] | None = None
    # per-request sampler stages by name, [{"name": "dry", "multiplier": 0.8}, "xtc"], and vLLM's allowed_token_ids
    samplers: list[dict[str, Any] | str] | None = None
    allowed_token_ids: list[int] | None = None
    # speculative decoding (--speculative-config): false opts this request out; speculative_config tunes it
    # for this request ({"num_speculative_tokens": 2}; method and model must be the engine's when given)
    speculative: bool = True
    speculative_config: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = _bounded(16, "max_tokens")
    logprobs: int | None = _bounded(None, "logprobs")
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result: the call it answers


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = _bounded(None, "max_tokens", CHAT_RANGES)
    max_completion_tokens: int | None = _bounded(None, "max_completion_tokens", CHAT_RANGES)
    logprobs: bool = False
    top_logprobs: int | None = _bounded(None, "top_logprobs")
    # tool calling (fw.server.tools.plan, docs/tool-calling.md); tool_prompt is TGI's name
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    tool_prompt: str | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def error_body(message: str, error_type: str, status: int, param: str | None = None) -> dict:
    """OpenAI's error shape; `code` carries the HTTP status, as vLLM does."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": status}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """The body of every error status (see `error_body`), for /openapi.json."""

    error: ErrorDetail


class EmbeddingRequest(_Request):
    """POST /v1/embeddings, as OpenAI's: `input` a string, a list of strings, token ids or a list of
    token-id lists; `encoding_format` float or base64; `dimensions` for Matryoshka models."""

    model: str | None = None
    input: Union[str, list[str], list[int], list[list[int]]]
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None
