"""The `llama3_json` tool-call parser: Llama 3.1/3.2's JSON tool calls, where the whole reply is
one or more bare objects `{"name": "get_weather", "parameters": {"city": "Paris"}}` (separated
by `;`, optionally after `<|python_tag|>`). A reply that does not start with such an object is
plain content, as in vLLM's parser of the same name; an object that is not a call, and anything
after it, stays content too. Recognises Llama 3.1/3.2 chat templates by their JSON call
instruction."""

from __future__ import annotations

import json

from fw.plugins import ToolParserSpec, hookimpl
from fw.tool_parsing import ContentGate, ParsedItem, call_from_object

FW_PLUGIN_API_VERSION = "1.0"
PYTHON_TAG = "<|python_tag|>"
# Llama 3.1's own instruction (its template carries this sentence; detection looks for it).
TEMPLATE_MARK = '"parameters": dictionary of argument name and its value'
TOOL_PROMPT_FORMAT = ('To call a function, respond with only a JSON object in the format {"name": function name, '
                      '"parameters": dictionary of argument name and its value}. Do not use variables.')
_DECODER = json.JSONDecoder()


class Llama3JsonParser:
    """Undecided while only whitespace (or part of `<|python_tag|>`) has come; then either calls
    (the reply starts with `{` or the tag) or content for the rest of the reply."""

    def __init__(self) -> None:
        self._buf = ""
        self._mode = "undecided"  # -> "calls" | "content"
        self._gate = ContentGate()

    def feed(self, text: str) -> list[ParsedItem]:
        self._buf += text
        out: list[ParsedItem] = []
        if self._mode == "undecided":
            head = self._buf.lstrip()
            if not head or (head.startswith(PYTHON_TAG[:len(head)]) and len(head) < len(PYTHON_TAG)):
                return out
            if head.startswith(PYTHON_TAG) or head.startswith("{"):
                self._mode = "calls"
                self._buf = head.removeprefix(PYTHON_TAG)
            else:
                self._mode = "content"
        if self._mode == "calls":
            self._calls(out)
        if self._mode == "content":
            self._content(out, self._buf)
            self._buf = ""
        return out

    def _calls(self, out: list[ParsedItem]) -> None:
        """Release each complete call object; switch to content at the first thing that is not one."""
        while True:
            self._buf = self._buf.lstrip().lstrip(";").lstrip()
            if not self._buf:
                return
            if not self._buf.startswith("{"):
                self._mode = "content"
                return
            try:
                obj, end = _DECODER.raw_decode(self._buf)
            except json.JSONDecodeError:
                return  # not complete yet (or never: finish() releases it as content)
            call = call_from_object(obj, ("parameters", "arguments"))
            if call is None:
                self._mode = "content"
                return
            self._gate.call()
            out.append(call)
            self._buf = self._buf[end:]

    def _content(self, out: list[ParsedItem], text: str) -> None:
        released = self._gate.add(text)
        if released:
            out.append(released)

    def finish(self) -> list[ParsedItem]:
        out: list[ParsedItem] = []
        if self._mode == "calls":
            self._calls(out)
        self._content(out, self._buf)
        self._buf = ""
        tail = self._gate.finish()
        if tail:
            out.append(tail)
        return out


def new_parser(tools: list[dict]) -> Llama3JsonParser:
    return Llama3JsonParser()


def detects(chat_template: str) -> bool:
    return TEMPLATE_MARK in chat_template


@hookimpl
def fw_register_tool_parsers(register) -> None:
    register(ToolParserSpec(
        name="llama3_json",
        factory=new_parser,
        detects=detects,
        priority=5,
        tool_prompt_format=TOOL_PROMPT_FORMAT,
        description='bare {"name": ..., "parameters": ...} objects, ";"-separated (Llama 3.1/3.2 JSON tool calls)',
    ))
