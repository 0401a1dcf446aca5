"""Structured output through `fw serve` on SmolLM2 with the openai SDK: OpenAI's
response_format (json_schema, json_object) on chat and completions, vLLM's
guided_* fields in extra_body with a per-request backend, 16 concurrent requests
mixing schemas and unconstrained ones, and 400s that name the backend and the
reason while the server stays healthy."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest
from server_fixtures import assert_error_body, client, model, running_server  # noqa: F401 (fixtures)
from structured_cases import CHOICES, REGEX, SCHEMAS, prompt_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = ("--kv-cache-memory", "512MiB", "--dtype", "bfloat16", "--max-batch-size", "128")
    with running_server(args, tmp_path_factory.mktemp("structured")) as s:
        yield s


def json_schema_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


@pytest.mark.parametrize("backend", ["xgrammar", "outlines"])
def test_chat_response_format_json_schema(client, model, backend) -> None:
    r = client.chat.completions.create(model=model, messages=prompt_for("person"), temperature=1.0, seed=5, n=4,
                                       max_tokens=120, response_format=json_schema_format("person"),
                                       extra_body={"guided_decoding_backend": backend})
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS["person"])


def test_chat_json_object_streamed(client, model) -> None:
    stream = client.chat.completions.create(model=model, messages=prompt_for("car"), temperature=1.0, seed=2,
                                            max_tokens=200, response_format={"type": "json_object"}, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert isinstance(json.loads(text), dict)


def test_completions_guided_regex_and_choice(client, model) -> None:
    r = client.completions.create(model=model, prompt="A city and a number:", temperature=1.0, seed=9, n=8,
                                  max_tokens=30, extra_body={"guided_regex": REGEX})
    assert all(re.fullmatch(REGEX, c.text) for c in r.choices), [c.text for c in r.choices]
    r = client.completions.create(model=model, prompt="The best city is", temperature=1.0, seed=9, n=8,
                                  max_tokens=10, extra_body={"guided_choice": CHOICES})
    assert {c.text for c in r.choices} <= set(CHOICES)


def test_sixteen_concurrent_mixed_requests(server, model) -> None:
    """Constrained requests batched with plain greedy ones: each plain answer is the one the same request
    gets alone (fw's CPU kernels compute each row the same way at any batch size), each constrained one
    valid."""
    names = list(SCHEMAS)

    async def plain(client: openai.AsyncOpenAI) -> str:
        r = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0, max_tokens=20)
        return r.choices[0].message.content

    async def one(client: openai.AsyncOpenAI, i: int):
        if i % 4 == 3:  # unconstrained, greedy
            return i, None, await plain(client)
        name = names[i % len(names)]
        r = await client.chat.completions.create(model=model, messages=prompt_for(name), temperature=1.0,
                                                 seed=i, max_tokens=160, response_format=json_schema_format(name))
        return i, name, r.choices[0].message.content

    async def run():
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", timeout=300,
                                      max_retries=0) as client:
            alone = await plain(client)
            return alone, await asyncio.gather(*(one(client, i) for i in range(16)))

    alone, results = asyncio.run(run())
    batched = [text for _, name, text in results if name is None]
    assert alone and batched == [alone] * 4, (alone, batched)
    for _, name, text in results:
        if name is not None:
            jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_bad_constraints_are_400s_naming_backend_and_reason(server, model) -> None:
    with server.client() as http:
        cases = [
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                          "schema": {"type": "nonsense"}}}},
             None),
            ({"guided_regex": "(unclosed", "guided_decoding_backend": "xgrammar"}, "xgrammar"),
            ({"guided_grammar": 'root ::= "a"', "guided_decoding_backend": "outlines"}, "outlines"),
            ({"guided_decoding_backend": "nosuch", "guided_regex": "a"}, "nosuch"),
            ({"guided_regex": "a", "guided_choice": ["a"]}, "one output constraint"),
            ({"response_format": {"type": "yaml"}}, "yaml"),
        ]
        for extra, needle in cases:
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **extra}
            err = assert_error_body(http.post("/v1/chat/completions", json=body), 400)
            if needle:
                assert needle in err["message"], err
        ok = http.post("/v1/chat/completions", json={"model": model, "max_tokens": 5,
                                                      "messages": [{"role": "user", "content": "hi"}]})
        assert ok.status_code == 200
        assert http.get("/health").status_code == 200


def test_streamed_choices_of_different_lengths_finish_once(client, model) -> None:
    """n > 1 with choices of different lengths: a finished choice stays in its request's later
    outputs, and must not be announced again with the others' tokens."""
    stream = client.completions.create(model=model, prompt="Say:", temperature=1.0, seed=4, n=6, max_tokens=20,
                                       stream=True, extra_body={"guided_choice": ["no", "yes it is true, yes"]})
    texts: dict[int, str] = {}
    finished: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            assert c.index not in finished, f"choice {c.index} has a chunk after its finish_reason"
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                finished[c.index] = c.finish_reason
    assert sorted(finished) == list(range(6)) and set(texts.values()) <= {"no", "yes it is true, yes"}
