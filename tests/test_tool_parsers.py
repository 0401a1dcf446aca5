"""Tool-call parsing without a model: the built-in `hermes` and `llama3_json` parsers (whole text
and streamed in every chunking, several calls, malformed blocks kept as content, text around
calls), the streams that turn a choice's text into OpenAI `tool_calls` deltas (named, required's
JSON array, auto), the `tool_parser` plugin kind (listing, a third-party parser, selection), and
the request checks, schema and prompt building of fw.server.tools.plan."""

from __future__ import annotations

import json
import random

import plugin_fixtures as pf
import pytest

from fw.cli.main import main
from fw.errors import InvalidRequestError, UnknownImplementationError
from fw.plugins.manager import PluginManager, reset_plugin_manager
from fw.server.tools import plan as T
from fw.server.protocol import ChatCompletionRequest, ChatMessage
from fw.server.routes.chat import message_dicts
from fw.server.tools.streams import ArrayCallStream, NamedCallStream, ParserCallStream
from fw.tool_parsing import ToolCall, parse_tool_calls


@pytest.fixture(scope="module")
def parsers():
    return PluginManager(entry_points=pf.fw_entry_points()).load().registry("tool_parser")


def parse(parsers, name: str, text: str):
    return parse_tool_calls(parsers.get(name).factory([]), text)


def chunkings(text: str, seeds: int = 25):
    """The text cut into pieces of 1..5 characters, `seeds` ways, plus one character at a time."""
    yield list(text)
    for seed in range(seeds):
        rng, pieces, i = random.Random(seed), [], 0
        while i < len(text):
            n = rng.randint(1, 5)
            pieces.append(text[i:i + n])
            i += n
        yield pieces


def streamed(parser, pieces):
    items = [item for piece in pieces for item in parser.feed(piece)] + parser.finish()
    return "".join(i for i in items if isinstance(i, str)), [i for i in items if isinstance(i, ToolCall)]


def block(name: str, args: dict, key: str = "arguments") -> str:
    return f'<tool_call>\n{json.dumps({"name": name, key: args})}\n</tool_call>'


WEATHER, TIME = {"city": "Paris", "unit": "celsius"}, {"timezone": "Europe/Oslo"}
HERMES_CASES = [
    # (text, expected content, expected calls)
    (block("get_weather", WEATHER), "", [("get_weather", WEATHER)]),
    ("Let me check.\n" + block("get_weather", WEATHER) + "\n" + block("get_time", TIME) + "\nOne moment.",
     "Let me check.\nOne moment.", [("get_weather", WEATHER), ("get_time", TIME)]),
    ("No call here, just <b>text</b>.\n", "No call here, just <b>text</b>.\n", []),
    ("before <tool_call>{not json}</tool_call> after", "before <tool_call>{not json}</tool_call> after", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),  # no name
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
     []),  # arguments not an object
    (block("f", {"x": 1}, key="parameters") + block("g", {}), "", [("f", {"x": 1}), ("g", {})]),
    ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>', "", [("f", {"x": 2})]),  # JSON text
    ('ok <tool_call>{"name": "f"}', "ok", [("f", {})]),  # end tag cut off, body complete: still a call
    ('ok <tool_call>{"name": "f", "argu', 'ok <tool_call>{"name": "f", "argu', []),  # cut inside: content
    ("a <tool_c", "a <tool_c", []),  # a partial start tag at the end is text
    ("Ünïcödé ✓ " + block("f", {"s": "é✓"}), "Ünïcödé ✓", [("f", {"s": "é✓"})]),
]


@pytest.mark.parametrize("text,content,calls", HERMES_CASES)
def test_hermes_whole_and_streamed(parsers, text, content, calls) -> None:
    whole_content, whole_calls = parse(parsers, "hermes", text)
    assert whole_content == content
    assert [(c.name, json.loads(c.arguments)) for c in whole_calls] == calls
    for pieces in chunkings(text):
        assert streamed(parsers.get("hermes").factory([]), pieces) == (whole_content, whole_calls)


def test_hermes_releases_content_before_the_call_is_complete(parsers) -> None:
    p = parsers.get("hermes").factory([])
    assert p.feed("Checking the weather") == ["Checking the weather"]
    assert p.feed(" now <tool") == [" now"]  # the space waits for more text; "<tool" may start a tag
    assert p.feed('_call>{"name": "f", ') == []
    assert p.feed('"arguments": {}}</tool_call> done') == [ToolCall("f", "{}"), " done"]
    assert p.finish() == []


LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', "", [("get_weather", WEATHER)]),
    ('<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "arguments": {"a": 1}}', "",
     [("f", {}), ("g", {"a": 1})]),
    ('  {"name": "f", "parameters": {"a": [1, "}"]}}\n\nThat is all.', "That is all.", [("f", {"a": [1, "}"]})]),
    ("The answer is {\"name\": 1}.", "The answer is {\"name\": 1}.", []),  # does not start with a call: content
    ('{"answer": 42}', '{"answer": 42}', []),  # an object that is not a call
    ('{"name": "f", "parameters": {}} {"oops": 1}', '{"oops": 1}', [("f", {})]),
    ('{"name": "f", "parameters": {"a": ', '{"name": "f", "parameters": {"a": ', []),  # truncated
    ("   ", "   ", []),
]


@pytest.mark.parametrize("text,content,calls", LLAMA_CASES)
def test_llama3_json_whole_and_streamed(parsers, text, content, calls) -> None:
    whole_content, whole_calls = parse(parsers, "llama3_json", text)
    assert whole_content == content
    assert [(c.name, json.loads(c.arguments)) for c in whole_calls] == calls
    for pieces in chunkings(text):
        assert streamed(parsers.get("llama3_json").factory([]), pieces) == (whole_content, whole_calls)


# -- the OpenAI delta streams -----------------------------------------------------------------------


def rebuild(deltas: list[dict]) -> tuple[str, list[tuple[str, str]]]:
    """What a client makes of the deltas, checking OpenAI's shape on the way: a call's first delta
    has index, id, type, name and arguments ""; later ones only argument fragments."""
    content, calls = "", {}
    for d in deltas:
        assert set(d) in ({"content"}, {"tool_calls"}), d
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            assert len(d["tool_calls"]) == 1
            if tc["index"] not in calls:
                assert tc["id"].startswith("call_") and tc["type"] == "function", tc
                assert tc["function"]["arguments"] == "" and tc["function"]["name"]
                assert tc["index"] == len(calls)
                calls[tc["index"]] = [tc["function"]["name"], ""]
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}, tc
                calls[tc["index"]][1] += tc["function"]["arguments"]
    return content, [tuple(c) for _, c in sorted(calls.items())]


def run_stream(make, pieces):
    stream = make()
    deltas = [d for piece in pieces for d in stream.feed(piece)] + stream.finish()
    return stream, deltas


ARRAYS = [
    ('[{"name": "get_weather", "parameters": {"city": "Pa\\"ris", "unit": "celsius"}}, '
     '{"name": "get_time", "parameters": {"timezone": "Europe/Oslo"}}]',
     [("get_weather", '{"city": "Pa\\"ris", "unit": "celsius"}'), ("get_time", '{"timezone": "Europe/Oslo"}')]),
    # whitespace everywhere, braces inside strings, parameters before the name, empty parameters
    (' [ { "parameters" : { "a" : [1, {"b": "}],{"}] } , "name" : "f" } ,{"name":"g","parameters":{}} ] ',
     [("f", '{ "a" : [1, {"b": "}],{"}] }'), ("g", "{}")]),
    ('[{"name": "f", "arguments": {"x": null}}]', [("f", '{"x": null}')]),  # "arguments" read as well
    ('[{"name": "f", "parameters": {"x": "unfinish', [("f", '{"x": "unfinish')]),  # cut by max_tokens
]


@pytest.mark.parametrize("text,calls", ARRAYS)
def test_required_array_stream(text, calls) -> None:
    whole = ArrayCallStream()
    whole.feed(text)
    whole.finish()
    message = whole.message()
    assert message["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == calls
    assert len({c["id"] for c in message["tool_calls"]}) == len(calls)
    assert whole.finish_reason("stop") == "tool_calls" and whole.finish_reason("length") == "length"
    for pieces in chunkings(text, seeds=10):
        stream, deltas = run_stream(ArrayCallStream, pieces)
        assert rebuild(deltas) == ("", calls)
        assert [c["function"] for c in stream.message()["tool_calls"]] == [c["function"] for c in message["tool_calls"]]


def test_required_array_streams_arguments_as_they_grow() -> None:
    stream = ArrayCallStream()
    assert stream.feed('[{"name": "get_w') == []
    first = stream.feed('eather", "parameters": {"ci')
    assert [d["tool_calls"][0]["function"] for d in first] == [{"name": "get_weather", "arguments": ""},
                                                               {"arguments": '{"ci'}]
    assert stream.feed('ty": "Oslo"}}') == [{"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Oslo"}'}}]}]
    assert stream.feed("]") == []


def test_named_stream_is_the_arguments() -> None:
    text = '{"timezone": "Europe/Oslo"}'
    for pieces in chunkings(text, seeds=5):
        stream, deltas = run_stream(lambda: NamedCallStream("get_time"), pieces)
        assert rebuild(deltas) == ("", [("get_time", text)])
        assert stream.message()["content"] is None
        assert stream.finish_reason("stop") == "stop"  # OpenAI's finish reason for a named choice
    stream, deltas = run_stream(lambda: NamedCallStream("f"), [""])  # nothing generated: still one call
    assert rebuild(deltas) == ("", [("f", "")])


def test_auto_stream_through_a_parser(parsers) -> None:
    text = HERMES_CASES[1][0]
    for pieces in chunkings(text, seeds=5):
        stream, deltas = run_stream(lambda: ParserCallStream(parsers.get("hermes").factory([])), pieces)
        content, calls = rebuild(deltas)
        assert content == "Let me check.\nOne moment."
        assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", WEATHER), ("get_time", TIME)]
        assert stream.message()["content"] == content and stream.finish_reason("stop") == "tool_calls"
    plain = ParserCallStream(parsers.get("hermes").factory([]))
    plain.feed("")
    plain.finish()
    assert plain.message() == {"role": "assistant", "content": ""} and plain.finish_reason("stop") == "stop"
    only_call = ParserCallStream(parsers.get("hermes").factory([]))
    only_call.feed(block("f", {}))
    only_call.finish()
    assert only_call.message()["content"] is None


# -- the plugin kind -------------------------------------------------------------------------------


def test_tool_parser_kind_is_listed(capsys, isolated_plugins) -> None:
    reset_plugin_manager()
    assert main(["plugins", "list", "--json", "--kind", "tool_parser"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)["plugins"]}
    assert rows["hermes"]["provides"] == {"tool_parser": ["hermes"]}
    assert rows["llama3_json"]["provides"] == {"tool_parser": ["llama3_json"]}
    assert rows["hermes"]["status"] == "loaded" and rows["hermes"]["module"] == "fw.backends.tool_parsers.hermes"


THIRD_PARTY = """
from fw.plugins import hookimpl
from fw.plugins.specs import ToolParserSpec
from fw.tool_parsing import TaggedCallParser, parse_json_call

FW_PLUGIN_API_VERSION = "1.0"


@hookimpl
def fw_register_tool_parsers(register):
    register(ToolParserSpec(
        name="bracket", factory=lambda tools: TaggedCallParser("[CALL]", "[/CALL]", parse_json_call),
        detects=lambda template: "[CALL]" in template or "<tool_call>" in template, priority=50,
        tool_prompt_format="Write [CALL]{...}[/CALL]."))
"""


def test_third_party_parser_selected_by_name_and_by_template(root) -> None:
    module = pf.unique("fw_bracket")
    pf.make_distribution(root, pf.unique("fw-bracket"), {module: THIRD_PARTY}, {"bracket": module})
    registry = PluginManager(entry_points=pf.fw_entry_points(root)).load().registry("tool_parser")
    spec = T.select_tool_parser(registry, "bracket", "")
    assert parse_tool_calls(spec.factory([]), 'hi [CALL]{"name": "f", "arguments": {}}[/CALL]') == \
        ("hi", [ToolCall("f", "{}")])
    # auto: the highest priority among the parsers that recognise the template
    assert T.select_tool_parser(registry, "auto", "... <tool_call> ...").name == "bracket"
    assert T.select_tool_parser(registry, "auto", '... "parameters": dictionary of argument name and its value').name \
        == "llama3_json"


def test_parser_selection_errors(parsers) -> None:
    assert T.select_tool_parser(parsers, "auto", "{{ '<tool_call>' }}").name == "hermes"
    with pytest.raises(InvalidRequestError, match="--tool-call-parser NAME .*hermes.*tool_choice \"required\""):
        T.select_tool_parser(parsers, "auto", "{{ messages }}")
    with pytest.raises(UnknownImplementationError, match="--tool-call-parser: no tool parser named 'nosuch'"):
        T.check_tool_parser_flag(parsers, "nosuch")


# -- requests: tools, tool_choice, schemas, messages, prompts ---------------------------------------

GET_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
GET_TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"$ref": "#/$defs/tz"}}, "$defs": {"tz": {"type": "string"}}}}}


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


def plan(parsers, template: str = "<tool_call>", **fields):
    return T.plan_tools(request(**fields), parsers, "auto", template)


def test_tool_choice_plans(parsers) -> None:
    assert plan(parsers) is None and plan(parsers, tools=[]) is None
    assert plan(parsers, tools=[GET_WEATHER], tool_choice="none") is None
    assert plan(parsers, tool_choice="auto") is None  # auto without tools: nothing to call
    auto = plan(parsers, tools=[GET_WEATHER])
    assert auto.choice == "auto" and auto.parser.name == "hermes" and not auto.constrains
    named = plan(parsers, tools=[GET_WEATHER, GET_TIME],
                 tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.constrains and named.schema() == GET_TIME["function"]["parameters"]
    required = plan(parsers, tools=[GET_WEATHER, GET_TIME], tool_choice="required")
    schema = required.schema()
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert schema["$defs"] == {"tz": {"type": "string"}}  # hoisted to the root, where the $ref points
    names = [b["properties"]["name"] for b in schema["items"]["anyOf"]]
    assert names == [{"type": "string", "enum": ["get_weather"]}, {"type": "string", "enum": ["get_time"]}]
    assert "$defs" not in schema["items"]["anyOf"][1]["properties"]["parameters"]
    single = plan(parsers, tools=[GET_WEATHER], tool_choice="required", parallel_tool_calls=False)
    assert single.schema()["maxItems"] == 1
    no_params = plan(parsers, tools=[{"type": "function", "function": {"name": "ping"}}], tool_choice="required")
    assert no_params.functions[0].parameters == {"type": "object", "properties": {}}


@pytest.mark.parametrize("fields,param,needle", [
    ({"tools": [GET_WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'nope', which is not among"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", "has no tools"),
    ({"tools": [GET_WEATHER], "tool_choice": "sometimes"}, "tool_choice", "must be none, auto, required"),
    ({"tools": [GET_WEATHER], "tool_choice": {"function": "f"}}, "tool_choice", "a named tool_choice is"),
    ({"tools": [{"type": "retrieval"}]}, "tools", 'type "function"'),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools", "name must be a non-empty string"),
    ({"tools": [GET_WEATHER, GET_WEATHER]}, "tools", "names must be unique"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools",
     '"type": "object"'),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}]}, "tools", "properties.a.type: .*'strin'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "required": "a"}}}]}, "tools", "required: .*is not of type 'array'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "array", "minItems": -1}}}}}]}, "tools", "minItems: .*less than the minimum of 0"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"anyOf": []}}}}}]}, "tools", "anyOf: .*should be non-empty"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": 3}}}}]}, "tools", "properties.a: .*is not of type 'object', 'boolean'"),
])
def test_bad_tool_requests(parsers, fields, param, needle) -> None:
    with pytest.raises(InvalidRequestError, match=needle) as err:
        plan(parsers, **fields)
    assert err.value.param == param


def test_deeply_nested_schema_is_a_clear_error(parsers) -> None:
    schema = {"type": "object"}
    for _ in range(5000):
        schema = {"type": "object", "properties": {"a": schema}}
    with pytest.raises(InvalidRequestError, match="nests too deeply") as err:
        plan(parsers, tools=[{"type": "function", "function": {"name": "f", "parameters": schema}}])
    assert err.value.param == "tools"


def test_constraint_conflicts(parsers) -> None:
    make = lambda r: r  # noqa: E731 - the request itself stands in for its sampling params
    for fields, source in (({"response_format": {"type": "json_object"}}, "response_format"),
                           ({"guided_regex": "a+"}, "guided_regex"), ({"guided_choice": ["a"]}, "guided_choice")):
        req = request(tools=[GET_WEATHER], tool_choice="required", **fields)
        with pytest.raises(InvalidRequestError, match=f"{source} cannot be combined") as err:
            T.tool_sampling_params(req, T.plan_tools(req, parsers, "auto", ""), make)
        assert err.value.param == source
        auto = request(tools=[GET_WEATHER], **fields)  # auto does not constrain: both may be given
        assert T.tool_sampling_params(auto, T.plan_tools(auto, parsers, "hermes", ""), make) is auto


def test_messages_pass_tool_calls_and_results_through() -> None:
    messages = [ChatMessage(role="user", content="weather?"),
                ChatMessage(role="assistant", content=None, tool_calls=[
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]),
                ChatMessage(role="tool", tool_call_id="call_1", content="12 C")]
    out = message_dicts(messages)
    assert out[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}
    assert out[2] == {"role": "tool", "content": "12 C", "tool_call_id": "call_1"}
    with pytest.raises(InvalidRequestError, match=r"messages\[0\]: only assistant messages carry tool_calls"):
        message_dicts([ChatMessage(role="user", content="x", tool_calls=[{"function": {"name": "f"}}])])
    with pytest.raises(InvalidRequestError, match=r"messages\[0\].tool_calls\[0\]"):
        message_dicts([ChatMessage(role="assistant", tool_calls=[{"id": "x"}])])


# A Qwen-like template that shows tools and calls, and SmolLM2's, which ignores both.
TOOLS_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}{{ c.function.arguments | tojson }}</tool_call>"
    "{% endfor %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
PLAIN_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def hf_tokenizer(template: str):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", chat_template=template)


CONVERSATION = [
    ChatMessage(role="user", content="weather in Oslo?"),
    ChatMessage(role="assistant", tool_calls=[{"id": "c1", "type": "function",
                                               "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]),
    ChatMessage(role="tool", tool_call_id="c1", content="12 C"),
]


def test_template_that_shows_tools_gets_them(parsers) -> None:
    p = plan(parsers, tools=[GET_WEATHER, GET_TIME])
    text = T.render_with_tools(hf_tokenizer(TOOLS_TEMPLATE), message_dicts(CONVERSATION), p, True, None)
    assert text == ('<tools>get_weather;get_time;</tools><|user|>weather in Oslo?<|assistant|>'
                    '<tool_call>get_weather{"city": "Oslo"}</tool_call><|tool|>12 C<|assistant|>')


def test_template_that_ignores_tools_gets_a_tool_prompt(parsers) -> None:
    tok = hf_tokenizer(PLAIN_TEMPLATE)
    p = plan(parsers, tools=[GET_WEATHER], template=PLAIN_TEMPLATE + "<tool_call>")
    text = T.render_with_tools(tok, message_dicts(CONVERSATION), p, True, None)
    prompt = T.tool_prompt(p)
    assert prompt.startswith(T.TOOL_PROMPT + "\n\n" + json.dumps(GET_WEATHER["function"]))
    assert prompt.endswith(parsers.get("hermes").tool_prompt_format)  # auto: the parser's own format
    assert text == (f"<|system|>{prompt}<|user|>weather in Oslo?"
                    '<|assistant|>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]<|tool|>12 C<|assistant|>')
    # an existing system message gets the prompt appended; the request may replace the intro line
    p = plan(parsers, tools=[GET_WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
             tool_prompt="Functions:")
    text = T.render_with_tools(tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
                               p, True, None)
    assert text.startswith("<|system|>Be brief.\n\nFunctions:\n\n{")
    assert text.endswith(T.NAMED_FORMAT.format(name="get_weather") + "<|user|>hi<|assistant|>")
    required = plan(parsers, tools=[GET_WEATHER], tool_choice="required")
    assert T.tool_prompt(required).endswith(T.REQUIRED_FORMAT)
