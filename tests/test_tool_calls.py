"""Tool calling through `fw serve` on SmolLM2 (bf16, sampling at temperature 1.0, so the grammar and
not luck makes the calls valid) with the openai SDK: tool_choice "required" and a named function,
streamed and not, their arguments validated with jsonschema against the tool's schema; tool_choice
"auto" with the hermes parser (the text steered into a <tool_call> block by a guided_regex, which
auto allows) parsed into a call with the text around it left as content; the tool prompt fw adds
for SmolLM2's template, which ignores tools; and the 400s of bad tool requests."""

from __future__ import annotations

import json

import jsonschema
import pytest
from server_fixtures import assert_error_body, client, model, running_server  # noqa: F401 (fixtures)

pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object",
        "properties": {"timezone": {"type": "string", "pattern": "^[A-Z][a-z]{2,10}/[A-Z][a-z]{2,10}$"}},
        "required": ["timezone"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The current time in a time zone",
                                      "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather like in Paris, and what time is it there?"}]
GET_TIME = {"type": "function", "function": {"name": "get_time"}}
HERMES_REGEX = (r'Sure\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo|Rome)", '
                r'"unit": "(celsius|fahrenheit)"\}\}\n</tool_call>\nDone\.')


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # No prefix caching: a streamed and a non-streamed request with one seed then compute the same
    # shapes, so they sample the same tokens and their calls can be compared.
    args = ("--kv-cache-memory", "256MiB", "--dtype", "bfloat16", "--tool-call-parser", "hermes",
            "--no-enable-prefix-caching")
    with running_server(args, tmp_path_factory.mktemp("tools")) as s:
        yield s


def check_calls(calls) -> list[tuple[str, str]]:
    """Every call is a function call to one of the tools, with arguments valid for its schema."""
    assert calls, "no tool_calls"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_"), call
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len({call.id for call in calls}) == len(calls)
    return [(call.function.name, call.function.arguments) for call in calls]


def collect(stream) -> list[dict]:
    """Each streamed choice: content, calls [(name, arguments)] and finish_reason, checking OpenAI's
    delta shape (a call's first delta: index, id, type, name, arguments ""; then argument fragments)
    and that nothing of a choice follows its finish_reason."""
    choices: dict[int, dict] = {}
    for chunk in stream:
        for choice in chunk.choices:
            got = choices.setdefault(choice.index, {"content": "", "calls": {}, "finish_reason": None})
            assert got["finish_reason"] is None, f"choice {choice.index} has a chunk after its finish_reason"
            got["finish_reason"] = choice.finish_reason
            got["content"] += choice.delta.content or ""
            calls = got["calls"]
            for tc in choice.delta.tool_calls or []:
                if tc.index not in calls:
                    assert tc.index == len(calls) and tc.type == "function" and tc.id.startswith("call_"), tc
                    assert tc.function.name in SCHEMAS and tc.function.arguments == "", tc
                    calls[tc.index] = [tc.function.name, ""]
                else:
                    assert tc.id is None and tc.function.name is None, tc
                    calls[tc.index][1] += tc.function.arguments
    out = []
    for index in sorted(choices):
        got = choices[index]
        got["calls"] = [tuple(c) for _, c in sorted(got["calls"].items())]
        for name, arguments in got["calls"]:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        out.append(got)
    return out


# A small model at temperature 1 may go on adding calls to a "required" array until max_tokens (a
# truncated last call); parallel_tool_calls false (maxItems 1) ends the array after one call. Several
# calls in one array are covered without a model in test_tool_parsers.py.
ONE_CALL = {"parallel_tool_calls": False}


def test_required_returns_valid_calls(client, model) -> None:
    r = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                       temperature=1.0, seed=1, n=3, max_tokens=60, **ONE_CALL)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert len(check_calls(choice.message.tool_calls)) == 1


@pytest.mark.parametrize("tool_choice,finish", [("required", "tool_calls"), (GET_TIME, "stop")])
def test_streamed_calls_equal_the_non_streamed(client, model, tool_choice, finish) -> None:
    kwargs = dict(model=model, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, temperature=1.0, seed=3,
                  max_tokens=60, **ONE_CALL)
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == finish and whole.message.content is None
    calls = check_calls(whole.message.tool_calls)
    if tool_choice == GET_TIME:
        assert [name for name, _ in calls] == ["get_time"]
    streamed = collect(client.chat.completions.create(**kwargs, stream=True))
    assert streamed == [{"content": "", "calls": calls, "finish_reason": finish}]


def test_named_function_samples(client, model) -> None:
    kwargs = dict(model=model, messages=MESSAGES, tools=TOOLS, tool_choice=GET_TIME, temperature=1.0, n=3,
                  max_tokens=40)
    for choice in client.chat.completions.create(**kwargs, seed=5).choices:
        assert choice.finish_reason == "stop"
        assert [name for name, _ in check_calls(choice.message.tool_calls)] == ["get_time"]
    # choices of different lengths: each streams its own call and finishes once
    streamed = collect(client.chat.completions.create(**kwargs, seed=8, stream=True))
    assert len(streamed) == 3
    for choice in streamed:
        assert choice["finish_reason"] == "stop" and [name for name, _ in choice["calls"]] == ["get_time"]


def test_required_through_the_outlines_backend(client, model) -> None:
    r = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                       temperature=1.0, seed=2, n=2, max_tokens=60, **ONE_CALL,
                                       extra_body={"guided_decoding_backend": "outlines"})
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        assert len(check_calls(choice.message.tool_calls)) == 1


def test_auto_with_the_hermes_parser(client, model) -> None:
    kwargs = dict(model=model, messages=MESSAGES, tools=TOOLS, temperature=1.0, seed=4, max_tokens=60,
                  extra_body={"guided_regex": HERMES_REGEX})
    r = client.chat.completions.create(**kwargs)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Sure.\nDone."
        assert [name for name, _ in check_calls(choice.message.tool_calls)] == ["get_weather"]
    [streamed] = collect(client.chat.completions.create(**kwargs, stream=True))
    assert streamed["content"] == "Sure.\nDone." and streamed["finish_reason"] == "tool_calls"
    assert [name for name, _ in streamed["calls"]] == ["get_weather"]


def test_auto_without_a_call_is_plain_content_and_the_tools_are_in_the_prompt(client, model) -> None:
    plain = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=8)
    auto = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=8)
    assert auto.choices[0].message.tool_calls is None and auto.choices[0].message.content
    assert auto.choices[0].finish_reason == "length"
    # SmolLM2's template ignores tools: fw describes them in a system prompt (docs/tool-calling.md)
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 100
    none = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                          temperature=0, max_tokens=8)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens  # none: the tools are ignored
    assert none.choices[0].message.content == plain.choices[0].message.content


def test_a_conversation_with_tool_results(client, model) -> None:
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    r = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice=GET_TIME,
                                       temperature=1.0, seed=6, max_tokens=60)
    check_calls(r.choices[0].message.tool_calls)


def test_bad_tool_requests_are_400s(server, model) -> None:
    bad_schema = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}]
    uncompilable = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "not": {"const": "x"}}}}}}]
    cases = [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_stock"}}}, "tool_choice",
         "get_stock"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tool_choice": GET_TIME}, "tool_choice", "has no tools"),
        ({"tools": bad_schema, "tool_choice": "none"}, "tools", "not a valid JSON Schema"),
        ({"tools": uncompilable, "tool_choice": "required"}, "tools", "xgrammar"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
         "cannot be combined"),
        ({"tools": TOOLS, "tool_choice": GET_TIME, "guided_regex": "a+"}, "guided_regex", "cannot be combined"),
        ({"tools": TOOLS, "tool_choice": "whenever"}, "tool_choice", "must be none, auto, required"),
    ]
    with server.client() as http:
        for extra, param, needle in cases:
            body = {"model": model, "messages": MESSAGES, "max_tokens": 5, **extra}
            err = assert_error_body(http.post("/v1/chat/completions", json=body), 400)
            assert err["param"] == param and needle in err["message"], (extra, err)
        ok = http.post("/v1/chat/completions", json={"model": model, "messages": MESSAGES, "max_tokens": 40,
                                                      "tools": TOOLS, "tool_choice": GET_TIME, "n": 2})
        assert ok.status_code == 200, ok.text
        assert http.get("/health").status_code == 200
