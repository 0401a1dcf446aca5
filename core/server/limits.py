"""The bounds of every sampling field a request may send, in one table.

A value outside them is a 400 whose message names the field and the allowed range. The table
also writes the bounds into /openapi.json and docs/server.md quotes it. References: vLLM's
`SamplingParams._verify_args` (top_k -1 or >= 1, penalties in [-2, 2], repetition_penalty > 0,
top_p in (0, 1], logprobs up to its --max-logprobs of 20) and TGI's validation (`max_stop_sequences`,
4 by default, as OpenAI's API; vLLM has no cap, so fw takes 16: room for the stop lists some
clients send, while a stop list stays cheap to check on every step)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fw.errors import InvalidRequestError


@dataclass(frozen=True)
class Range:
    """low <= value <= high (low < value with `low_open`); None: unbounded on that side."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    note: str = ""  # what special values mean, for the message

    def allows(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or value <= self.high

    def text(self) -> str:
        low, high = _number(self.low), _number(self.high)
        if self.low is not None and self.high is not None:
            text = f"in ({low}, {high}]" if self.low_open else f"between {low} and {high}"
        elif self.low is not None:
            text = f"greater than {low}" if self.low_open else f"at least {low}"
        else:
            text = f"at most {high}"
        return f"{text} ({self.note})" if self.note else text

    def schema(self) -> dict[str, Any]:
        """JSON-schema keywords for /openapi.json."""
        out: dict[str, Any] = {}
        if self.low is not None:
            out["exclusiveMinimum" if self.low_open else "minimum"] = self.low
        if self.high is not None:
            out["maximum"] = self.high
        return out


INT64 = 2**63
RANGES: dict[str, Range] = {
    "n": Range(1, 16),
    "temperature": Range(0, 2, note="0 is greedy"),
    "top_p": Range(0, 1, low_open=True),
    "top_k": Range(-1, 2**31 - 1, note="-1 and 0 turn it off; above the vocabulary size keeps every token"),
    "min_p": Range(0, 1),
    "repetition_penalty": Range(0, None, low_open=True, note="1 turns it off"),
    "presence_penalty": Range(-2, 2),
    "frequency_penalty": Range(-2, 2),
    "seed": Range(-INT64, INT64 - 1, note="64 bits"),
    "min_tokens": Range(0, None),
    "max_tokens": Range(0, None, note="0 with echo scores the prompt only"),
    "logprobs": Range(0, 20),
    "top_logprobs": Range(0, 20),
}
# chat has no echo: it must generate at least one token
CHAT_RANGES: dict[str, Range] = {**RANGES, "max_tokens": Range(1, None), "max_completion_tokens": Range(1, None)}

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256  # the detokenizer holds back up to this many characters of a stream
MAX_TOKEN_ID_LIST = 1024  # stop_token_ids; logit_bias entries
LIST_LIMITS: dict[str, int] = {"stop": MAX_STOP_STRINGS, "stop_token_ids": MAX_TOKEN_ID_LIST,
                               "logit_bias": MAX_TOKEN_ID_LIST}


def _number(value: float | None) -> str:
    if value is None:
        return ""
    if value == -INT64:
        return "-2^63"
    if value == INT64 - 1:
        return "2^63-1"
    return str(int(value)) if float(value).is_integer() else str(value)


def shown(value: Any) -> str:
    """A request's value in a message, cut short: a 4,000-digit integer is not repeated back."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}... ({len(text)} characters)"


def out_of_range(name: str, value: Any, bound: Range) -> InvalidRequestError:
    return InvalidRequestError(f"{name} must be {bound.text()}, got {shown(value)}", param=name)


def check_limits(req: Any, ranges: dict[str, Range], vocab_size: int) -> None:
    """Raise a 400 for the first field of `req` outside its bounds (fields left out are fine)."""
    for name, bound in ranges.items():
        value = getattr(req, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not bound.allows(value):
            raise out_of_range(name, value, bound)
    _check_stop(req.stop)
    for name, most in LIST_LIMITS.items():
        value = getattr(req, name, None)
        if name != "stop" and value is not None and len(value) > most:
            raise InvalidRequestError(f"{name} has {len(value)} entries; at most {most} are allowed", param=name)
    allowed = getattr(req, "allowed_token_ids", None)
    if allowed is not None and len(allowed) > vocab_size:
        raise InvalidRequestError(f"allowed_token_ids has {len(allowed)} entries, more than the vocabulary's "
                                  f"{vocab_size} tokens", param="allowed_token_ids")


def _check_stop(stop: str | list[str] | None) -> None:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequestError(f"stop has {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed",
                                  param="stop")
    for i, s in enumerate(stops):
        if not 1 <= len(s) <= MAX_STOP_CHARS:
            raise InvalidRequestError(f"stop[{i}] has {len(s)} characters; each stop string must have 1 to "
                                      f"{MAX_STOP_CHARS}", param="stop")


def limits_table() -> list[tuple[str, str]]:
    """(field, allowed values) rows, for docs/server.md and its test."""
    rows = [(name, bound.text()) for name, bound in RANGES.items()]
    rows.append(("max_tokens / max_completion_tokens (chat)", CHAT_RANGES["max_tokens"].text()))
    rows.append(("stop", f"at most {MAX_STOP_STRINGS} strings of 1 to {MAX_STOP_CHARS} characters"))
    rows.append(("stop_token_ids", f"at most {MAX_TOKEN_ID_LIST} ids, each in the vocabulary"))
    rows.append(("logit_bias", f"at most {MAX_TOKEN_ID_LIST} entries, values between -100 and 100"))
    rows.append(("allowed_token_ids", "at most the vocabulary size, each id in the vocabulary"))
    return rows
