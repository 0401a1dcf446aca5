"""Issue 21's server findings, on the FastAPI app in process over the tiny GQA model with --api-key:
admission before tokenizing, a byte bound on prompts, the key on every route but the open ones,
request text escaped in the log, bounded sampling fields, error messages that name the cause, and
an /openapi.json that lists the statuses the server sends. (The event-loop stall needs a real
server and a stream: tests/test_server_event_loop.py.)"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from conftest import make_llm
from fw.server.app import OPEN_ROUTES, build_app
from fw.server.async_engine import AsyncEngine
from fw.server.config import ServerConfig
from fw.server.limits import MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_TOKEN_ID_LIST, limits_table
from fw.server.metrics import ServerMetrics
from fw.server.prompts import SHRINK
from fw.server.state import ServerState
from server_fixtures import assert_error_body

KEY = "sk-hardening"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMIT = 2  # --max-concurrent-requests
MAX_INPUT = 200  # --max-input-tokens
HI = [{"role": "user", "content": "hi"}]
DOCS = Path(__file__).resolve().parent.parent / "docs" / "server.md"


@pytest.fixture(scope="module")
def served(gqa_dir):
    """(TestClient with the key, ServerState)."""
    engine = make_llm(gqa_dir).engine
    async_engine = AsyncEngine(engine)
    config = ServerConfig(api_key=KEY, max_concurrent_requests=LIMIT, max_input_tokens=MAX_INPUT)
    state = ServerState(async_engine, config, ["tiny"], ServerMetrics("tiny", "sdpa", lambda: async_engine.stats))
    with TestClient(build_app(state), headers=AUTH) as client:
        yield client, state
    asyncio.run(async_engine.drain(5.0))


@pytest.fixture
def http(served):
    return served[0]


class CountingTokenizer:
    """The engine's tokenizer, counting the calls that render or tokenize."""

    def __init__(self, inner):
        self._inner = inner
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self._inner(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        self.calls += 1
        return self._inner.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


@pytest.fixture
def counting(served, monkeypatch) -> CountingTokenizer:
    engine = served[1].engine.engine
    counter = CountingTokenizer(engine.tokenizer)
    monkeypatch.setattr(engine, "tokenizer", counter)
    return counter


# -- admission before tokenizing, a byte bound before tokenizing -----------------------------------

BIG = "word " * 200_000  # 1 MB


def test_a_busy_server_refuses_before_it_tokenizes(served, counting):
    http, state = served
    state.in_flight = LIMIT  # every slot busy
    try:
        for path, body in (("/v1/completions", {"prompt": BIG}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": BIG}]}),
                           ("/tokenize", {"messages": [{"role": "user", "content": BIG}]})):
            err = assert_error_body(http.post(path, json=body), 429)
            assert "--max-concurrent-requests" in err["message"]
            assert counting.calls == 0, f"{path}: the prompt was rendered or tokenized before its 429"
    finally:
        state.in_flight = 0


def test_a_prompt_over_the_byte_bound_is_refused_untokenized(served, counting):
    http, state = served
    limit = state.prompt_limits.max_bytes
    longest = state.prompt_limits.longest_token
    assert limit == MAX_INPUT * longest * SHRINK
    over = "x" * (limit + 1)
    for path, body in (("/v1/completions", {"prompt": over}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": over}]})):
        err = assert_error_body(http.post(path, json=body), 400)
        assert f"at most {MAX_INPUT} tokens (--max-input-tokens)" in err["message"], err
        assert f"no prompt over {limit} bytes" in err["message"], err
    assert counting.calls == 1  # the chat template, rendered once; nothing tokenized
    assert state.in_flight == 0
    # just under the bound: tokenized, then refused by its token count, which the message gives
    err = assert_error_body(http.post("/v1/completions", json={"prompt": "x" * (limit // 2)}), 400)
    assert re.search(r"the prompt has \d+ tokens, more than the 200", err["message"]), err


def test_a_byte_bound_never_refuses_a_prompt_that_fits(served):
    """The longest entry's bytes times SHRINK: a prompt of the longest token repeated to the token
    limit is well inside the bound."""
    http, state = served
    vocab = state.tokenizer.get_vocab()
    longest = max(vocab, key=lambda t: len(t.encode()))
    text = state.tokenizer.convert_tokens_to_string([longest] * (MAX_INPUT - 1))
    assert len(text.encode()) <= state.prompt_limits.max_bytes
    r = http.post("/v1/completions", json={"prompt": text, "max_tokens": 1})
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:  # only the token count may refuse it
        assert "tokens, more than the" in r.json()["error"]["message"] or "context" in r.json()["error"]["message"]


# -- the API key --------------------------------------------------------------------------------------


def test_tokenize_and_detokenize_need_the_key(served):
    http, _ = served
    anonymous = {"Authorization": ""}
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1, 2]})):
        err = assert_error_body(http.post(path, json=body, headers=anonymous), 401)
        assert err["type"] == "authentication_error"
        assert http.post(path, json=body).status_code == 200
    for path in OPEN_ROUTES - {"/docs/oauth2-redirect"}:
        assert http.get(path, headers=anonymous).status_code == 200, path
    assert http.get("/v1/fw/plugins", headers=anonymous).status_code == 401
    assert http.get("/nowhere", headers=anonymous).status_code == 401  # no route list for strangers


def test_the_key_is_not_in_the_config_repr(served):
    assert KEY not in repr(served[1].config)


# -- the log -----------------------------------------------------------------------------------------


def test_request_text_is_escaped_in_the_log(served, caplog):
    http, _ = served
    forged = "x\n2099-01-01 00:00:00,000 ERROR fw.server: forged"
    with caplog.at_level(logging.INFO, logger="fw.server"):
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, forged: 1, "a\x1b[2Jb": 2})
    assert r.status_code == 200, r.text
    lines = [rec.getMessage() for rec in caplog.records if "ignored request fields" in rec.getMessage()]
    assert lines, caplog.text
    assert "\n" not in lines[-1] and "\x1b" not in lines[-1], lines[-1]
    assert repr(forged) in lines[-1] and repr("a\x1b[2Jb") in lines[-1]


# -- sampling fields: bounded, with messages naming the field and the range ---------------------------

C, CHAT = "/v1/completions", "/v1/chat/completions"
BOUNDS = [  # (path, field, value, words the message must have)
    (C, "top_k", -5, "between -1 and 2147483647"),
    (C, "stop", ["s"] * 10_000, f"at most {MAX_STOP_STRINGS}"),
    (C, "stop", ["y" * (MAX_STOP_CHARS + 1)], f"1 to {MAX_STOP_CHARS}"),
    (CHAT, "stop", "", f"1 to {MAX_STOP_CHARS}"),
    (C, "n", 17, "between 1 and 16"),
    (CHAT, "n", 0, "between 1 and 16"),
    (C, "logprobs", 21, "between 0 and 20"),
    (CHAT, "top_logprobs", -1, "between 0 and 20"),
    (C, "temperature", 2.5, "between 0 and 2"),
    (C, "top_p", 0, "in (0, 1]"),
    (C, "min_p", 1.5, "between 0 and 1"),
    (C, "repetition_penalty", 0, "greater than 0"),
    (CHAT, "presence_penalty", -3, "between -2 and 2"),
    (C, "frequency_penalty", 2.5, "between -2 and 2"),
    (C, "seed", 2**64, "between -2^63 and 2^63-1"),
    (C, "min_tokens", -1, "at least 0"),
    (C, "max_tokens", -1, "at least 0"),
    (CHAT, "max_tokens", 0, "at least 1"),
    (CHAT, "max_completion_tokens", 0, "at least 1"),
    (C, "stop_token_ids", [1] * (MAX_TOKEN_ID_LIST + 1), f"at most {MAX_TOKEN_ID_LIST}"),
    (C, "logit_bias", {str(i): 1 for i in range(MAX_TOKEN_ID_LIST + 1)}, f"at most {MAX_TOKEN_ID_LIST}"),
    (C, "allowed_token_ids", [1] * 600, "more than the vocabulary's 512"),
]


@pytest.mark.parametrize("path,name,value,words", BOUNDS, ids=[f"{r[1]}-{i}" for i, r in enumerate(BOUNDS)])
def test_sampling_fields_out_of_bounds_are_400s_naming_field_and_range(http, path, name, value, words):
    body = {"prompt": "hi"} if path == C else {"messages": HI}
    err = assert_error_body(http.post(path, json={**body, name: value, "max_tokens": 2} if name not in (
        "max_tokens", "max_completion_tokens") else {**body, name: value}), 400)
    assert err["param"] == name, err
    assert err["message"].startswith(name) and words in err["message"], err


def test_a_huge_integer_is_not_repeated_back(http):
    err = assert_error_body(http.post(C, json={"prompt": "hi", "n": 10**1000}), 400)
    assert len(err["message"]) < 200 and "characters" in err["message"], err


@pytest.mark.parametrize("extra", [{"top_k": -1}, {"top_k": 0}, {"top_k": 5}, {"stop": ["z"] * MAX_STOP_STRINGS},
                                   {"seed": -(2**63)}, {"temperature": 0}])
def test_sampling_fields_at_their_bounds_are_served(http, extra):
    r = http.post(C, json={"prompt": "hi", "max_tokens": 2, **extra})
    assert r.status_code == 200, r.text


def test_docs_give_every_bound(http):
    text = " ".join(DOCS.read_text().split())
    for name, allowed in limits_table():
        assert f"| `{name}` | {allowed} |" in text, name


# -- error messages that name the cause --------------------------------------------------------------

RAW = {"Content-Type": "application/json"}
CAUSES = [  # (path, body bytes, headers, words the message must have)
    (C, b'{"prompt": "hi", "n": ' + b"7" * 5000 + b"}", RAW, "integer with 5000 digits"),
    (C, b"[" * 10_000 + b"]" * 10_000, RAW, "nests arrays or objects too deeply"),
    (C, b'{"prompt": "caf\xe9"}', RAW, "not UTF-8 text: byte 0xe9 at offset 15"),
    (C, b'{"prompt": "hi"}', {"Content-Type": "text/plain"}, "Content-Type is 'text/plain'"),
    (CHAT, b"prompt=hi", {"Content-Type": "application/x-www-form-urlencoded"},
     "Content-Type is 'application/x-www-form-urlencoded' (curl -d sends this"),
    (C, b'{"prompt": "hi"}', {}, "no Content-Type header"),
    (C, b"[1, 2]", RAW, "must be a JSON object, got an array"),
    (C, b"null", RAW, "must be a JSON object, got null"),
    (C, b"", RAW, "the request body is empty"),
    (CHAT, json.dumps({"messages": [{"role": "user", "content": [{"type": "text"}]}]}).encode(), RAW,
     'messages[0].content[0]: a text part needs a "text" field'),
    (CHAT, json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                  {"type": "text", "text": 5}]}]}).encode(), RAW,
     'messages[0].content[1]: "text" must be a string, got int'),
    (CHAT, json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).encode(), RAW,
     "only text parts are supported, got type 'image_url'"),
]


@pytest.mark.parametrize("path,body,headers,words", CAUSES, ids=[c[3][:30] for c in CAUSES])
def test_unreadable_requests_name_their_cause(served, path, body, headers, words):
    http, _ = served
    r = http.post(path, content=body, headers={**AUTH, **headers} if headers else AUTH)
    if not headers:  # TestClient sends no Content-Type for raw content unless told
        assert "content-type" not in {k.lower() for k in r.request.headers}
    err = assert_error_body(r, 400)
    assert words in err["message"], err


# -- /openapi.json -----------------------------------------------------------------------------------


def test_openapi_lists_the_statuses_sent_and_never_422(http):
    schema = http.get("/openapi.json").json()
    assert '"422"' not in json.dumps(schema) and "HTTPValidationError" not in json.dumps(schema)
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        assert {"200", "400", "401", "404", "413", "429", "500", "503"} <= set(responses), sorted(responses)
        body = responses["400"]["content"]["application/json"]["schema"]
        assert body == {"$ref": "#/components/schemas/ErrorResponse"}
    for path in ("/tokenize", "/detokenize"):
        assert {"400", "401", "413", "429"} <= set(schema["paths"][path]["post"]["responses"])
    assert set(schema["components"]["schemas"]["ErrorResponse"]["properties"]) == {"error"}
    fields = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert fields["n"]["minimum"] == 1 and fields["n"]["maximum"] == 16
    assert fields["top_p"]["exclusiveMinimum"] == 0 and fields["top_k"]["minimum"] == -1
