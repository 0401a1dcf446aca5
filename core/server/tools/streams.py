"""One chat choice's generated text -> OpenAI message deltas (`content`, `tool_calls`), for the
three tool choices that produce calls: a named function, `required`, and `auto` (a parser plugin).

Each stream is fed the text as it is generated and returns the deltas it can release, in order;
it keeps the whole message as the sum of those deltas, so a non-streamed answer (the same stream
fed the whole text) is exactly what the streamed deltas add up to. A call's first delta carries
index, id, type, function.name and arguments ""; later ones carry argument fragments."""

from __future__ import annotations

import json
import uuid

from fw.tool_parsing import ToolCall, ToolParser

Delta = dict  # {"content": str} or {"tool_calls": [one OpenAI tool-call delta]}

ARGUMENT_KEYS = ("parameters", "arguments")
_WHITESPACE = " \t\r\n"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallStream:
    """The shared bookkeeping: the message so far, and the deltas that build it."""

    content_when_empty: str | None = None

    def __init__(self) -> None:
        self.content: list[str] = []
        self.calls: list[dict] = []

    def feed(self, text: str) -> list[Delta]:
        raise NotImplementedError

    def finish(self) -> list[Delta]:
        return []

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """`tool_calls` when the model stopped after making calls (OpenAI's and vLLM's choice)."""
        return "tool_calls" if engine_reason == "stop" and self.calls else engine_reason

    def message(self) -> dict:
        content: str | None = "".join(self.content)
        if not content:  # null beside calls (OpenAI's shape); auto without calls keeps its "" as before
            content = None if self.calls else self.content_when_empty
        message: dict = {"role": "assistant", "content": content}
        if self.calls:
            message["tool_calls"] = self.calls
        return message

    # -- deltas ------------------------------------------------------------------------------

    def _text(self, text: str) -> Delta:
        self.content.append(text)
        return {"content": text}

    def _start(self, name: str) -> Delta:
        call_id = new_call_id()
        self.calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": ""}})
        return {"tool_calls": [{"index": len(self.calls) - 1, "id": call_id, "type": "function",
                                "function": {"name": name, "arguments": ""}}]}

    def _arguments(self, index: int, fragment: str) -> Delta:
        self.calls[index]["function"]["arguments"] += fragment
        return {"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}


class NamedCallStream(ToolCallStream):
    """tool_choice names a function: the output is constrained to its parameters' schema, so the
    generated text is the arguments, streamed as it comes. finish_reason stays the engine's
    ("stop"), as OpenAI answers a named choice."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def feed(self, text: str) -> list[Delta]:
        out = [] if self.calls else [self._start(self.name)]
        if text:
            out.append(self._arguments(0, text))
        return out

    def finish(self) -> list[Delta]:
        return self.feed("")

    def finish_reason(self, engine_reason: str | None) -> str | None:
        return engine_reason


class _Element:
    """One `{"name": ..., "parameters": ...}` object of the array, as far as it has been read."""

    __slots__ = ("name", "args_start", "args_end", "args_sent", "index")

    def __init__(self) -> None:
        self.name: str | None = None
        self.args_start: int | None = None
        self.args_end = 0
        self.args_sent = 0
        self.index: int | None = None


class ArrayCallStream(ToolCallStream):
    """tool_choice required: the output is constrained to a JSON array of
    `{"name": <a tool's name>, "parameters": <its arguments>}` objects. An incremental scanner
    follows the array character by character (string and escape state, nesting depth, the key
    being read at element level) and streams each element's parameters text as it grows; a call
    starts once its name is complete (parameters that come first are held until then). The
    arguments are the generated text of the parameters value, not a re-serialisation."""

    def __init__(self) -> None:
        super().__init__()
        self.text = ""
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.state = "outside"  # element level: key, key_string, colon, before_value, value, after_value
        self.key: str | None = None
        self.key_start = 0
        self.value_start = 0
        self.value_end = 0
        self.element: _Element | None = None

    def feed(self, text: str) -> list[Delta]:
        out: list[Delta] = []
        start = len(self.text)
        self.text += text
        for i in range(start, len(self.text)):
            self._char(i, self.text[i], out)
        if self.element is not None:
            self._flush(self.element, out)
        return out

    def _char(self, i: int, ch: str, out: list[Delta]) -> None:
        element_level = self.depth == 2
        if self.in_string:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
                if element_level and self.state == "key_string":
                    self.key = _loads(self.text[self.key_start:i + 1])
                    self.state = "colon"
            if self.state == "value":
                self.value_end = i + 1
            return
        if ch in _WHITESPACE:
            return
        if element_level and self.state == "before_value":
            self.state, self.value_start = "value", i
        if ch == '"':
            self.in_string = True
            if element_level and self.state == "key":
                self.state, self.key_start = "key_string", i
        elif ch in "{[":
            if self.depth == 1 and ch == "{":
                self.element, self.state = _Element(), "key"
            self.depth += 1
        elif ch in "}]":
            if element_level:  # the element's own closing brace
                self._end_value()
                self._flush(self.element, out)
                self.element, self.state = None, "outside"
            self.depth -= 1
            if self.depth < 2:
                return
        elif element_level and ch == ",":
            self._end_value()
            self.state = "key"
            return
        elif element_level and ch == ":" and self.state == "colon":
            self.state = "before_value"
            return
        if self.state == "value":
            self.value_end = i + 1

    def _end_value(self) -> None:
        if self.state != "value" or self.element is None:
            return
        element, value = self.element, self.text[self.value_start:self.value_end]
        if self.key == "name":
            name = _loads(value)
            element.name = name if isinstance(name, str) else None
        self._track_arguments(element)
        self.state = "after_value"

    def _track_arguments(self, element: _Element) -> None:
        """While (or just after) the parameters value is read, the element's arguments span it
        (the first arguments key wins if a model repeats one)."""
        if self.state == "value" and self.key in ARGUMENT_KEYS and element.args_start in (None, self.value_start):
            element.args_start, element.args_end = self.value_start, self.value_end

    def _flush(self, element: _Element | None, out: list[Delta]) -> None:
        """Release what is known of `element`: its call's start once the name is complete, then
        its parameters text so far."""
        if element is None:
            return
        if element is self.element:
            self._track_arguments(element)
        if element.name is None:
            return
        if element.index is None:
            out.append(self._start(element.name))
            element.index = len(self.calls) - 1
        if element.args_start is not None:
            fragment = self.text[element.args_start + element.args_sent:element.args_end]
            if fragment:
                element.args_sent += len(fragment)
                out.append(self._arguments(element.index, fragment))


def _loads(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


class ParserCallStream(ToolCallStream):
    """tool_choice auto: a `tool_parser` plugin reads calls out of free text. Content streams as
    the parser releases it; each call streams once the parser has it whole (its start, then its
    arguments in one fragment), so a block that turns out malformed can still become content."""

    content_when_empty = ""

    def __init__(self, parser: ToolParser):
        super().__init__()
        self.parser = parser

    def feed(self, text: str) -> list[Delta]:
        return self._deltas(self.parser.feed(text) if text else [])

    def finish(self) -> list[Delta]:
        return self._deltas(self.parser.finish())

    def _deltas(self, items) -> list[Delta]:
        out: list[Delta] = []
        for item in items:
            if isinstance(item, ToolCall):
                out.append(self._start(item.name))
                out.append(self._arguments(len(self.calls) - 1, item.arguments))
            elif item:
                out.append(self._text(item))
        return out
