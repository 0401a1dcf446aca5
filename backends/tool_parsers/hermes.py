"""The `hermes` tool-call parser: calls written as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

among plain text, as the chat templates of Hermes 2 Pro, Qwen2.5 and Qwen3 ask models to write
them. Recognises any chat template that mentions `<tool_call>`. A block whose body is not one JSON
object with a string "name" (and an "arguments" object, or "parameters") stays content."""

from __future__ import annotations

from fw.plugins import ToolParserSpec, hookimpl
from fw.tool_parsing import TaggedCallParser, parse_json_call

FW_PLUGIN_API_VERSION = "1.0"
START, END = "<tool_call>", "</tool_call>"
# The instruction Qwen2.5's own template gives; fw adds it to the tool prompt of templates that ignore tools.
TOOL_PROMPT_FORMAT = ("For each function call, return a json object with function name and arguments within "
                      f"{START}{END} XML tags:\n{START}\n"
                      '{"name": <function-name>, "arguments": <args-json-object>}\n'
                      f"{END}")


def new_parser(tools: list[dict]) -> TaggedCallParser:
    return TaggedCallParser(START, END, parse_json_call)


def detects(chat_template: str) -> bool:
    return START in chat_template


@hookimpl
def fw_register_tool_parsers(register) -> None:
    register(ToolParserSpec(
        name="hermes",
        factory=new_parser,
        detects=detects,
        priority=10,
        tool_prompt_format=TOOL_PROMPT_FORMAT,
        description="<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call> blocks (Hermes 2 Pro, Qwen2.5, Qwen3)",
    ))
