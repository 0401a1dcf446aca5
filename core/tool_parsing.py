"""Tool-call parsing for `tool_choice: "auto"`: the contract a `tool_parser` plugin implements,
and the pieces the built-in parsers share (public plugin API, like fw.grammar for grammar backends).

A parser is made per generated choice (`ToolParserSpec.factory(tools)`), fed the generated text
as it grows, and answers with what it can release, in order: plain content (str) and complete
calls (`ToolCall`). Whole-text parsing is the same parser fed everything at once
(`parse_tool_calls`), so streamed and non-streamed answers agree by construction. A parser holds
text back only while it may still turn out to be a call; text that does not parse as a call
(a malformed block) is released as content, never dropped."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence, Union, runtime_checkable


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


ParsedItem = Union[str, ToolCall]


@runtime_checkable
class ToolParser(Protocol):
    """One choice's parser (used from one task; not shared between choices)."""

    def feed(self, text: str) -> list[ParsedItem]:
        """Take the next piece of generated text; return what can be released now, in order."""

    def finish(self) -> list[ParsedItem]:
        """The generation ended: release everything still held (unfinished calls as content, or as
        calls when the parser can still read them)."""


def parse_tool_calls(parser: ToolParser, text: str) -> tuple[str, list[ToolCall]]:
    """Whole-text parsing: (content, calls)."""
    items = parser.feed(text) + parser.finish()
    content = "".join(item for item in items if isinstance(item, str))
    return content, [item for item in items if isinstance(item, ToolCall)]


def call_from_object(obj: Any, argument_keys: Sequence[str] = ("arguments", "parameters")) -> ToolCall | None:
    """{"name": str, "arguments": {...} or its JSON text} -> a ToolCall, or None when `obj` is not
    a call. A missing arguments key means no arguments ("{}"); arguments that are neither an object
    nor JSON text of one make it not a call."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    key = next((k for k in argument_keys if k in obj), None)
    args = {} if key is None else obj[key]
    if isinstance(args, str):
        try:
            if not isinstance(json.loads(args), dict):
                return None
        except json.JSONDecodeError:
            return None
        return ToolCall(name, args)
    if not isinstance(args, dict):
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker` (text that must be
    held back: the next piece may complete the marker)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ContentGate:
    """Releases content with the calls cut out, the same whether the text comes at once or piece by
    piece. Whitespace next to calls is not content: trailing whitespace is held until more content
    follows, and a run of calls between two pieces of content leaves one separator, the whitespace
    before the run (else after it): "Let me check.\n<call>\nDone." -> "Let me check.\nDone."."""

    def __init__(self) -> None:
        self._pending = ""  # trailing whitespace of released content
        self._after_call = False  # only whitespace since the last call
        self._before = ""  # whitespace before the current run of calls
        self._after = ""  # whitespace after it so far
        self._released = False

    def add(self, text: str) -> str:
        if self._after_call:
            rest = text.lstrip()
            self._after += text[:len(text) - len(rest)]
            if not rest:
                return ""
            self._after_call = False
            text = ((self._before or self._after) if self._released else "") + rest
        text = self._pending + text
        body = text.rstrip()
        self._pending = text[len(body):]
        self._released = self._released or bool(body)
        return body

    def call(self) -> None:
        if not self._after_call:
            self._before, self._after_call = self._pending, True
        self._pending, self._after = "", ""

    def finish(self) -> str:
        pending, self._pending = ("" if self._after_call else self._pending), ""
        return pending


class TaggedCallParser:
    """Calls written as `<start>BODY<end>` blocks among plain text (Hermes/Qwen's
    `<tool_call>{...}</tool_call>`). Text outside blocks is content, released as it comes except a
    tail that may begin the start tag; a block is held until its end tag and released as a call if
    `parse_body(BODY)` reads one, else as content (the block's text, tags included). A block still
    open when generation ends is a call if its body already reads as one (the end tag was cut, e.g.
    by a stop string), else content."""

    def __init__(self, start: str, end: str, parse_body: Callable[[str], ToolCall | None]):
        self.start, self.end, self.parse_body = start, end, parse_body
        self._buf = ""
        self._inside = False
        self._gate = ContentGate()

    def feed(self, text: str) -> list[ParsedItem]:
        self._buf += text
        out: list[ParsedItem] = []
        while True:
            if not self._inside:
                i = self._buf.find(self.start)
                if i < 0:
                    keep = held_prefix(self._buf, self.start)
                    self._content(out, self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    return out
                self._content(out, self._buf[:i])
                self._buf = self._buf[i + len(self.start):]
                self._inside = True
            else:
                j = self._buf.find(self.end)
                if j < 0:
                    return out
                self._block(out, self._buf[:j], closed=True)
                self._buf = self._buf[j + len(self.end):]
                self._inside = False

    def finish(self) -> list[ParsedItem]:
        out: list[ParsedItem] = []
        if self._inside:
            self._block(out, self._buf, closed=False)
        else:
            self._content(out, self._buf)
        self._buf, self._inside = "", False
        tail = self._gate.finish()
        if tail:
            out.append(tail)
        return out

    def _content(self, out: list[ParsedItem], text: str) -> None:
        released = self._gate.add(text)
        if released:
            out.append(released)

    def _block(self, out: list[ParsedItem], body: str, closed: bool) -> None:
        call = self.parse_body(body)
        if call is not None:
            self._gate.call()
            out.append(call)
        else:
            self._content(out, self.start + body + (self.end if closed else ""))


def parse_json_call(body: str, argument_keys: Sequence[str] = ("arguments", "parameters")) -> ToolCall | None:
    """A block body that is exactly one JSON call object (surrounding whitespace allowed)."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    return call_from_object(obj, argument_keys)


__all__ = [
    "ToolCall",
    "ParsedItem",
    "ToolParser",
    "parse_tool_calls",
    "call_from_object",
    "held_prefix",
    "ContentGate",
    "TaggedCallParser",
    "parse_json_call",
]
