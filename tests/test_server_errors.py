"""`fw serve` under bad input and overload, on a tiny model (fast) with --api-key, a short
--max-length and --max-concurrent-requests 4.

Every malformed or hostile request gets the right status and an OpenAI error body, and the server
keeps serving between them; a burst over the concurrency limit gets only 200s and 429s; clients
that vanish mid-request are aborted. The last test checks that none of this leaked an admission
slot: four requests at once are all still admitted."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from server_fixtures import assert_error_body, metric, running_server, wait_for

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_LENGTH = 256
LIMIT = 4  # --max-concurrent-requests


@pytest.fixture(scope="module")
def server(gqa_dir, tmp_path_factory):
    args = ["--model", str(gqa_dir), "--api-key", KEY, "--max-length", str(MAX_LENGTH),
            "--max-concurrent-requests", str(LIMIT), "--num-kv-blocks", "128", "--dtype", "float32"]
    with running_server(args, tmp_path_factory.mktemp("tiny_errors")) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with server.client(api_key=KEY, timeout=30) as c:
        yield c


def good_request(http: httpx.Client) -> None:
    # ignore_eos: the tiny random model samples at temperature 1 and may draw its EOS within 3 tokens
    r = http.post("/v1/completions", json={"prompt": "The quick brown fox", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"


C, CHAT = "/v1/completions", "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]
LONG = " ".join(["model"] * 300)  # about 300 tokens: over --max-length 256


def _json(body) -> bytes:
    return json.dumps(body).encode()


# (id, method, path, body (dict: JSON; bytes: raw), headers (None: key + JSON), status)
ROWS = [
    # not JSON, or not a JSON object
    ("bad-json", "POST", C, b'{"prompt": "hi", ', None, 400),
    ("bad-json-chat", "POST", CHAT, b"{messages: [}", None, 400),
    ("json-array", "POST", C, b"[1, 2, 3]", None, 400),
    ("json-string", "POST", CHAT, b'"hello"', None, 400),
    ("json-null", "POST", C, b"null", None, 400),
    ("empty-body", "POST", CHAT, b"", None, 400),
    ("invalid-utf8", "POST", C, b'{"prompt": "caf\xe9 \xff\xfe", "max_tokens": 2}', None, 400),
    ("lone-surrogate-escape", "POST", C, b'{"prompt": "a\\ud800b", "max_tokens": 2}', None, 400),
    ("lone-surrogate-chat", "POST", CHAT, b'{"messages": [{"role": "user", "content": "\\udfff"}]}', None, 400),
    ("deeply-nested", "POST", C, b"[" * 50_000 + b"]" * 50_000, None, 400),
    ("text-plain", "POST", C, b'{"prompt": "hi"}', {**AUTH, "Content-Type": "text/plain"}, 400),
    # wrong types
    ("max_tokens-str", "POST", C, {"prompt": "hi", "max_tokens": "abc"}, None, 400),
    ("max_tokens-float", "POST", C, {"prompt": "hi", "max_tokens": 1.5}, None, 400),
    ("temperature-list", "POST", C, {"prompt": "hi", "temperature": [1]}, None, 400),
    ("messages-str", "POST", CHAT, {"messages": "hi"}, None, 400),
    ("prompt-int", "POST", C, {"prompt": 5}, None, 400),
    ("prompt-mixed-list", "POST", C, {"prompt": ["a", 5]}, None, 400),
    ("content-int", "POST", CHAT, {"messages": [{"role": "user", "content": 5}]}, None, 400),
    ("message-no-role", "POST", CHAT, {"messages": [{"content": "hi"}]}, None, 400),
    ("stream-not-bool", "POST", C, {"prompt": "hi", "stream": "maybe"}, None, 400),
    ("stop-int", "POST", C, {"prompt": "hi", "stop": 5}, None, 400),
    ("seed-str", "POST", C, {"prompt": "hi", "seed": "abc"}, None, 400),
    ("stream-options-bad", "POST", C, {"prompt": "hi", "stream": True, "stream_options": {"include_usage": "x"}},
     None, 400),
    # out-of-range values
    ("max_tokens-negative", "POST", C, {"prompt": "hi", "max_tokens": -1}, None, 400),
    ("max_tokens-huge", "POST", C, {"prompt": "hi", "max_tokens": 10**9}, None, 400),
    ("chat-max_tokens-huge", "POST", CHAT, {"messages": HI, "max_tokens": 10**9}, None, 400),
    ("chat-max_tokens-0", "POST", CHAT, {"messages": HI, "max_tokens": 0}, None, 400),
    ("temperature-100", "POST", C, {"prompt": "hi", "temperature": 100}, None, 400),
    ("temperature-nan", "POST", C, b'{"prompt": "hi", "temperature": NaN}', None, 400),
    ("top_p-0", "POST", C, {"prompt": "hi", "top_p": 0}, None, 400),
    ("n-0", "POST", C, {"prompt": "hi", "n": 0}, None, 400),
    ("n-1000", "POST", CHAT, {"messages": HI, "n": 1000}, None, 400),
    ("logprobs-50", "POST", C, {"prompt": "hi", "logprobs": 50}, None, 400),
    ("top_logprobs-50", "POST", CHAT, {"messages": HI, "logprobs": True, "top_logprobs": 50}, None, 400),
    ("top_logprobs-without-logprobs", "POST", CHAT, {"messages": HI, "top_logprobs": 2}, None, 400),
    ("presence_penalty-5", "POST", C, {"prompt": "hi", "presence_penalty": 5}, None, 400),
    ("min_p-2", "POST", C, {"prompt": "hi", "min_p": 2}, None, 400),
    ("repetition_penalty-0", "POST", C, {"prompt": "hi", "repetition_penalty": 0}, None, 400),
    ("min_tokens-over-max", "POST", C, {"prompt": "hi", "max_tokens": 4, "min_tokens": 10**9}, None, 400),
    ("seed-over-64-bits", "POST", C, {"prompt": "hi", "max_tokens": 2, "seed": 10**30}, None, 400),
    ("seed-over-64-bits-chat", "POST", CHAT, {"messages": HI, "max_tokens": 2, "seed": -(10**30)}, None, 400),
    ("stop-empty-string", "POST", C, {"prompt": "hi", "stop": [""]}, None, 400),
    # empty things
    ("messages-empty", "POST", CHAT, {"messages": []}, None, 400),
    ("prompt-empty-list", "POST", C, {"prompt": []}, None, 400),
    ("prompt-empty-token-list", "POST", C, {"prompt": [[]]}, None, 400),
    ("prompt-missing", "POST", C, {"max_tokens": 2}, None, 400),
    ("bad-role", "POST", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, None, 400),
    ("image-part", "POST", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]}, None, 400),
    # token ids
    ("prompt-token-out-of-vocab", "POST", C, {"prompt": [1, 99999], "max_tokens": 2}, None, 400),
    ("prompt-token-negative", "POST", C, {"prompt": [-1], "max_tokens": 2}, None, 400),
    ("logit_bias-non-integer-key", "POST", C, {"prompt": "hi", "logit_bias": {"abc": 5}}, None, 400),
    ("logit_bias-out-of-vocab", "POST", C, {"prompt": "hi", "logit_bias": {"99999": 5}}, None, 400),
    ("logit_bias-inf", "POST", C, b'{"prompt": "hi", "logit_bias": {"5": Infinity}}', None, 400),
    ("stop_token_ids-out-of-vocab", "POST", C, {"prompt": "hi", "stop_token_ids": [99999]}, None, 400),
    ("stop_token_ids-negative-chat", "POST", CHAT, {"messages": HI, "stop_token_ids": [-3]}, None, 400),
    # features this server does not have
    ("suffix", "POST", C, {"prompt": "def f(", "suffix": "return x"}, None, 400),
    ("best_of", "POST", C, {"prompt": "hi", "best_of": 3}, None, 400),
    ("response_format-bad-schema", "POST", CHAT, {"messages": HI, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}}, None, 400),
    ("response_format-unknown-type", "POST", CHAT, {"messages": HI, "response_format": {"type": "yaml"}},
     None, 400),
    ("guided_regex-unclosed", "POST", C, {"prompt": "hi", "guided_regex": "(a"}, None, 400),
    ("tools", "POST", CHAT, {"messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}]},
     None, 400),
    # the prompt over the context (the message names both numbers: checked below)
    ("prompt-over-context", "POST", C, {"prompt": LONG, "max_tokens": 2}, None, 400),
    ("chat-over-context", "POST", CHAT, {"messages": [{"role": "user", "content": LONG}]}, None, 400),
    # size, auth, model, routes
    ("body-10MB", "POST", C, _json({"prompt": "x" * 10_000_000}), None, 413),
    ("no-api-key", "POST", C, {"prompt": "hi"}, {"Content-Type": "application/json"}, 401),
    ("wrong-api-key", "POST", CHAT, {"messages": HI}, {"Authorization": "Bearer sk-wrong"}, 401),
    ("not-bearer", "POST", C, {"prompt": "hi"}, {"Authorization": KEY}, 401),
    ("models-without-key", "GET", "/v1/models", None, {}, 401),
    ("unknown-model", "POST", C, {"model": "gpt-5", "prompt": "hi"}, None, 404),
    ("unknown-model-chat", "POST", CHAT, {"model": "gpt-5", "messages": HI}, None, 404),
    ("get-on-post-route", "GET", C, None, None, 405),
    ("get-on-chat-route", "GET", CHAT, None, None, 405),
    ("unknown-route", "POST", "/v1/nope", {"prompt": "hi"}, None, 404),
    ("unknown-route-get", "GET", "/v2/models", None, None, 404),
    ("tokenize-neither", "POST", "/tokenize", {}, None, 400),
    ("detokenize-out-of-vocab", "POST", "/detokenize", {"tokens": [1, 10**20]}, None, 400),
]

# Accepted on purpose: unknown fields are ignored (and logged) as vLLM does; an empty text prompt
# still has this tokenizer's BOS token; a chunked body under the limit is fine.
ACCEPTED = [
    ("unknown-fields", C, {"prompt": "hi", "max_tokens": 2, "frobnicate": {"x": [1]}, "store": True}),
    ("unknown-fields-chat", CHAT, {"messages": [{"role": "user", "content": "hi", "mood": "sunny"}],
                                   "max_tokens": 2, "parallel_tool_calls": False, "frobnicate": 1}),
    ("empty-text-prompt", C, {"prompt": "", "max_tokens": 2}),
    ("tools-with-tool_choice-none", CHAT, {"messages": HI, "max_tokens": 2, "tool_choice": "none",
                                           "tools": [{"type": "function", "function": {"name": "f"}}]}),
    ("response_format-text", CHAT, {"messages": HI, "max_tokens": 2, "response_format": {"type": "text"}}),
    ("response_format-json_object", CHAT, {"messages": HI, "max_tokens": 2,
                                           "response_format": {"type": "json_object"}}),
    ("text-parts", CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                          "max_tokens": 2}),
    ("top_k-minus-one", C, {"prompt": "hi", "max_tokens": 2, "top_k": -1}),
    ("negative-seed", C, {"prompt": "hi", "max_tokens": 2, "seed": -1}),
]


def _send(server, method: str, path: str, body, headers) -> httpx.Response:
    """One row's request on a client of its own: no key unless the row sends one."""
    if headers is None:
        headers = {**AUTH, "Content-Type": "application/json"}
    content = _json(body) if isinstance(body, dict) else body
    with httpx.Client(base_url=server.url, timeout=30) as client:
        return client.request(method, path, content=content, headers=headers)


@pytest.mark.parametrize("name,method,path,body,headers,status", ROWS, ids=[r[0] for r in ROWS])
def test_hostile_request_gets_an_openai_error(server, http, name, method, path, body, headers, status):
    r = _send(server, method, path, body, headers)
    err = assert_error_body(r, status)
    assert err["code"] == status
    if status == 401:
        assert err["type"] == "authentication_error"
    if status == 404 and "model" in name:
        assert "gpt-5" in err["message"] and "gqa" in err["message"]
    if name.endswith("over-context"):
        prompt = {"prompt": LONG} if path == C else {"messages": [{"role": "user", "content": LONG}]}
        count = http.post("/tokenize", json=prompt).json()["count"]
        assert count > MAX_LENGTH and str(count) in err["message"] and str(MAX_LENGTH - 1) in err["message"], err
    good_request(http)  # the server is still serving


def test_there_are_enough_hostile_rows():
    assert len(ROWS) >= 30
    assert {r[5] for r in ROWS} >= {400, 401, 404, 405, 413}


@pytest.mark.parametrize("name,path,body", ACCEPTED, ids=[a[0] for a in ACCEPTED])
def test_lenient_requests_are_served(server, http, name, path, body):
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] in ("stop", "length")


def test_ignored_fields_are_logged(server, http):
    http.post(C, json={"prompt": "hi", "max_tokens": 1, "zzz_unknown_field": 1})
    wait_for(lambda: "zzz_unknown_field" in server.log(), 5, message="the ignored field in the log")


def test_chunked_body_over_the_limit_is_refused(server, http):
    """Without Content-Length the size is only known while reading: still 413, not a 10 MB read."""
    body = _json({"prompt": "x" * 10_000_000, "max_tokens": 1})

    def chunks():
        for i in range(0, len(body), 1 << 16):
            yield body[i:i + (1 << 16)]

    started = time.monotonic()
    r = http.post(C, content=chunks(), headers={"Content-Type": "application/json"})
    assert_error_body(r, 413)
    assert time.monotonic() - started < 5
    good_request(http)


def test_errors_are_counted_in_metrics(server):
    text = server.metrics_text()
    assert metric(text, "fw_request_errors_total", status="400") >= 40
    assert metric(text, "fw_request_errors_total", status="401") >= 1


# -- overload --------------------------------------------------------------------------------------


async def _one(http: httpx.AsyncClient, i: int) -> tuple[int, dict]:
    """Request i of a burst: even ones stream, odd ones do not. (status, body or summary)"""
    body = {"prompt": f"Request {i}: once upon a time", "max_tokens": 120, "ignore_eos": True,
            "temperature": 0}
    if i % 2:
        r = await http.post(C, json=body)
        return r.status_code, r.json()
    async with http.stream("POST", C, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            return r.status_code, json.loads(await r.aread())
        text, finish, done = "", None, False
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                for c in chunk["choices"]:
                    text += c["text"]
                    finish = c["finish_reason"] or finish
        return 200, {"choices": [{"text": text, "finish_reason": finish}], "done": done}


async def _burst(server, n: int) -> list[tuple[int, dict]]:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=30, limits=limits) as http:
        return await asyncio.wait_for(asyncio.gather(*(_one(http, i) for i in range(n))), timeout=90)


def test_burst_over_the_limit_gets_only_200s_and_429s(server, http):
    results = asyncio.run(_burst(server, 32))
    statuses = [s for s, _ in results]
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(429) >= 1 and statuses.count(200) >= 1, statuses
    for status, body in results:
        if status == 429:
            assert set(body) == {"error"} and body["error"]["message"] and body["error"]["code"] == 429
            assert body["error"]["type"] == "rate_limit_error"
            assert "--max-concurrent-requests" in body["error"]["message"]
        else:
            choice = body["choices"][0]
            assert choice["finish_reason"] == "length" and choice["text"], body
            assert body.get("done", True)
    good_request(http)


# -- clients that vanish -----------------------------------------------------------------------------

SLOW = {"prompt": "Once upon a time", "max_tokens": MAX_LENGTH - 40, "n": 16, "ignore_eos": True}


def _idle(server) -> bool:
    text = server.metrics_text()
    return metric(text, "fw_kv_cache_usage_ratio") == 0 and metric(text, "fw_num_requests_running") == 0 \
        and metric(text, "fw_num_requests_waiting") == 0


def _finished(server, reason: str) -> float:
    return metric(server.metrics_text(), "fw_request_success_total", finished_reason=reason)


def test_vanishing_clients_are_aborted(server, http):
    """A request whose client left is aborted, not run to its end: once the engine is idle again
    no choice has finished with "length" (16 choices of about 220 tokens each would have), and the
    abort is counted."""
    wait_for(lambda: _idle(server), 10, message="idle engine")
    chat = {"messages": HI, "max_tokens": MAX_LENGTH - 40, "n": 16, "ignore_eos": True}
    for path, body in ((C, SLOW), (CHAT, chat)):
        # mid-stream
        before, aborted = _finished(server, "length"), _finished(server, "abort")
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as c:
            with c.stream("POST", path, json={**body, "stream": True}) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line.startswith("data: ") and '"content": ""' not in line:
                        break
        wait_for(lambda: _idle(server), 5, message=f"idle after a closed stream on {path}")
        assert _finished(server, "length") == before, f"the abandoned stream on {path} ran to its end"
        wait_for(lambda: _finished(server, "abort") > aborted, 5, message="the abort counted")
        aborted = _finished(server, "abort")
        # before a non-streamed answer
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + path, json=body, headers=AUTH, timeout=httpx.Timeout(30, read=0.2))
        wait_for(lambda: _idle(server), 5, message=f"idle after a vanished non-streamed request on {path}")
        assert _finished(server, "length") == before, f"the abandoned non-streamed request on {path} ran to its end"
        wait_for(lambda: _finished(server, "abort") > aborted, 5, message="the abort counted")
        good_request(http)


def test_no_admission_slot_leaked(server, http):
    """After every kind of failure above (run first: file order), the limit still admits LIMIT
    requests at once: all of them get 200, though they overlap in time."""
    wait_for(lambda: _idle(server), 10, message="idle engine")

    async def together():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as client:
            async def one(i: int) -> tuple[int, float, float]:
                begin = time.monotonic()
                r = await client.post(C, json={**SLOW, "n": 4, "prompt": f"Story {i}:"})
                return r.status_code, begin, time.monotonic()

            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(LIMIT))), 60)

    results = asyncio.run(together())
    assert [s for s, _, _ in results] == [200] * LIMIT, results
    latest_start = max(b for _, b, _ in results)
    earliest_end = min(e for _, _, e in results)
    assert latest_start < earliest_end, "the requests did not overlap; the check proves nothing"
