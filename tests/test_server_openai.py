"""`fw serve` on the bundled SmolLM2 (no --model), driven by the official `openai` SDK: completions
and chat, streamed and not, n, logprobs, stop, seeds, echo with prompt logprobs, usage chunks and
vLLM's extra sampling fields. Then load on the same server: 64 concurrent streams that match their
one-at-a-time outputs and are counted in /metrics, and clients that leave mid-request."""

from __future__ import annotations

import asyncio
import collections
import json
import re
import shlex
import subprocess
import time

import httpx
import pytest
from server_fixtures import SMOLLM2_ARGS, client, metric, model, running_server, wait_for  # noqa: F401 (fixtures)

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(SMOLLM2_ARGS, tmp_path_factory.mktemp("smollm2")) as s:
        yield s


def greedy_chat(client, model, messages=CAPITAL, **kw):
    return client.chat.completions.create(model=model, messages=messages, temperature=0, **kw)


# -- the served model -----------------------------------------------------------------------------


def test_models_list_names_the_bundled_model(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct.Q4_1"]
    assert models[0].object == "model" and models[0].owned_by


def test_default_server_prints_a_curl_line_that_works(server):
    """With no --model the bundled SmolLM2 is served, and stdout has a ready-to-paste command."""
    lines = [ln for ln in server.stdout().splitlines() if ln.startswith("curl ")]
    assert len(lines) == 1, server.describe()
    line = lines[0]
    assert f"http://127.0.0.1:{server.port}/v1/chat/completions" in line
    # the exact printed line, through a shell (it targets 127.0.0.1 only)
    done = subprocess.run(line, shell=True, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    body = json.loads(done.stdout)
    assert "error" not in body, body
    assert body["object"] == "chat.completion" and body["model"] == "SmolLM2-135M-Instruct.Q4_1"
    assert body["choices"][0]["message"]["content"].strip()
    assert body["choices"][0]["finish_reason"] in ("stop", "length")


# -- completions ----------------------------------------------------------------------------------


def test_completion_streamed_equals_not_streamed(client, model):
    prompt = "The three primary colors are"
    full = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
    choice = full.choices[0]
    assert choice.text and choice.finish_reason in ("stop", "length")
    assert full.usage.prompt_tokens > 0 and 0 < full.usage.completion_tokens <= 12
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_completion_n2_and_logprobs(client, model):
    out = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, n=2, temperature=1,
                                    seed=7, logprobs=3, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage.completion_tokens == 16
    for c in out.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
        assert "".join(lp.tokens) == c.text
        assert all(x <= 0 for x in lp.token_logprobs)
        assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    greedy = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, temperature=0,
                                       logprobs=3)
    lp = greedy.choices[0].logprobs
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and max(top.values()) == pytest.approx(chosen, abs=1e-4), (token, top)


def test_echo_with_zero_max_tokens_scores_the_prompt(client, model, server):
    prompt = "The capital of France is Paris."
    out = client.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    c = out.choices[0]
    assert c.text == prompt
    ids = httpx.post(server.url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) == out.usage.prompt_tokens and out.usage.completion_tokens == 0
    assert "".join(lp.tokens) == prompt
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs[1:])
    # a likely word is likelier than an unlikely one in the same place
    paris = client.completions.create(model=model, prompt="The capital of France is Paris", max_tokens=0,
                                      echo=True, logprobs=1).choices[0].logprobs.token_logprobs[-1]
    banana = client.completions.create(model=model, prompt="The capital of France is banana", max_tokens=0,
                                       echo=True, logprobs=1).choices[0].logprobs.token_logprobs[-1]
    assert paris > banana


def test_stop_string_cuts_the_text(client, model):
    base = client.completions.create(model=model, prompt="Count: one, two, three,", max_tokens=16, temperature=0)
    text = base.choices[0].text
    words = [w for w in text.split() if len(w) > 2]
    assert len(words) >= 2, text
    stop = words[1]
    cut = client.completions.create(model=model, prompt="Count: one, two, three,", max_tokens=16,
                                    temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]


def test_seed_reproduces_sampled_text(client, model):
    def sample(seed):
        return client.completions.create(model=model, prompt="My favourite animal is", max_tokens=16,
                                         temperature=1, seed=seed).choices[0].text

    a = sample(1234)
    assert a == sample(1234)
    assert any(sample(s) != a for s in (1, 2, 3))


# -- chat -----------------------------------------------------------------------------------------


def test_chat_stream_deltas_equal_the_message(client, model):
    full = greedy_chat(client, model, max_tokens=24)
    msg = full.choices[0].message
    assert msg.role == "assistant" and msg.content.strip()
    assert full.choices[0].finish_reason in ("stop", "length")
    chunks = list(greedy_chat(client, model, max_tokens=24, stream=True,
                              stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == msg.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_without_max_tokens_is_served(client, model):
    """No max_tokens means "until done", even though this KV cache (256 MiB) holds fewer tokens
    than the model's 8192-token context."""
    out = greedy_chat(client, model)
    assert out.choices[0].finish_reason == "stop" and "Paris" in out.choices[0].message.content


def test_chat_n2_logprobs_and_top_logprobs(client, model):
    out = client.chat.completions.create(model=model, messages=CAPITAL, max_tokens=6, n=2, temperature=1, seed=3,
                                         logprobs=True, top_logprobs=2)
    assert sorted(c.index for c in out.choices) == [0, 1]
    total = 0
    for c in out.choices:
        content = c.logprobs.content
        total += len(content)
        assert "".join(t.token for t in content) == c.message.content
        for t in content:
            assert t.logprob <= 0 and len(t.top_logprobs) == 2
            assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
            assert bytes(t.bytes).decode("utf-8", "replace") == t.token
    assert total == out.usage.completion_tokens
    greedy = greedy_chat(client, model, max_tokens=6, logprobs=True, top_logprobs=3)
    for t in greedy.choices[0].logprobs.content:
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-4)


def test_chat_seed_reproduces_sampled_text(client, model):
    def sample(seed):
        return client.chat.completions.create(model=model, messages=CAPITAL, max_tokens=12, temperature=1,
                                              seed=seed).choices[0].message.content

    assert sample(99) == sample(99)


# -- vLLM's extra sampling fields (extra_body) ----------------------------------------------------


def test_ignore_eos_and_min_tokens_take_effect(client, model):
    short = greedy_chat(client, model, max_tokens=64)
    k = short.usage.completion_tokens
    assert short.choices[0].finish_reason == "stop" and k < 20
    out = greedy_chat(client, model, max_tokens=20, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 20 and out.choices[0].finish_reason == "length"
    assert out.choices[0].message.content.startswith(short.choices[0].message.content)
    longer = greedy_chat(client, model, max_tokens=64, extra_body={"min_tokens": k + 5})
    assert longer.usage.completion_tokens >= k + 5


def test_top_k_and_min_p_take_effect(client, model):
    greedy = client.completions.create(model=model, prompt="Water boils at", max_tokens=10, temperature=0)
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        hot = client.completions.create(model=model, prompt="Water boils at", max_tokens=10, temperature=1.5,
                                        seed=5, extra_body=extra)
        assert hot.choices[0].text == greedy.choices[0].text, extra
    plain = client.completions.create(model=model, prompt="Water boils at", max_tokens=10, temperature=1.5, seed=5)
    assert plain.choices[0].text != greedy.choices[0].text


def test_repetition_penalty_takes_effect(client, model):
    prompt = "one one one one one one one one"
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0)
    penalised = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0,
                                          extra_body={"repetition_penalty": 3.0})
    assert plain.choices[0].text != penalised.choices[0].text

    def most_repeated(text: str) -> int:
        return max(collections.Counter(re.findall(r"\w+", text)).values())

    assert most_repeated(penalised.choices[0].text) < most_repeated(plain.choices[0].text)


def test_stop_token_ids_take_effect(client, model, server):
    base = client.completions.create(model=model, prompt="The capital of France is", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    text = base.choices[0].text
    ids = httpx.post(server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    target = ids[4]
    assert ids.index(target) == 4
    cut = client.completions.create(model=model, prompt="The capital of France is", max_tokens=12, temperature=0,
                                    extra_body={"stop_token_ids": [target]})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens == 5  # the stop token is generated, then the request ends
    assert text.startswith(cut.choices[0].text) and len(cut.choices[0].text) < len(text)


# -- load: 64 concurrent streams ------------------------------------------------------------------

QUESTIONS = ["What is the capital of France?", "Name a primary color.", "What is 2 + 2?", "Say hello in Spanish."]


async def _stream_chat(http: httpx.AsyncClient, model: str, question: str) -> tuple[str, dict, str]:
    """One streamed chat over raw SSE: (text, usage, finish_reason)."""
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 16,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    text, usage, finish, done = "", None, None, False
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                continue
            chunk = json.loads(data)
            assert "error" not in chunk, chunk
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk["choices"]:
                text += c["delta"].get("content") or ""
                finish = c["finish_reason"] or finish
    assert done and usage is not None and finish in ("stop", "length")
    return text, usage, finish


def test_64_concurrent_streams_match_sequential_and_are_counted(client, model, server):
    sequential = {q: greedy_chat(client, model, messages=[{"role": "user", "content": q}], max_tokens=16)
                  for q in QUESTIONS}
    before = server.metrics_text()

    async def burst():
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
        async with httpx.AsyncClient(base_url=server.url, timeout=httpx.Timeout(120.0), limits=limits) as http:
            questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(64)]
            results = await asyncio.wait_for(
                asyncio.gather(*(_stream_chat(http, model, q) for q in questions)), timeout=150)
            return list(zip(questions, results))

    started = time.monotonic()
    results = asyncio.run(burst())
    elapsed = time.monotonic() - started
    assert len(results) == 64
    for q, (text, usage, finish) in results:
        ref = sequential[q]
        assert text == ref.choices[0].message.content, q
        assert finish == ref.choices[0].finish_reason
        assert usage["completion_tokens"] == ref.usage.completion_tokens
    after = server.metrics_text()
    backend = re.search(r'attention_backend="([^"]+)"', after).group(1)  # whichever auto-selection chose
    labels = {"model_name": model, "attention_backend": backend}
    assert metric(after, "fw_request_success_total", **labels) - metric(before, "fw_request_success_total",
                                                                         **labels) == 64
    generated = sum(usage["completion_tokens"] for _, (_, usage, _) in results)
    assert metric(after, "fw_generation_tokens_total", **labels) - metric(
        before, "fw_generation_tokens_total", **labels) == generated
    prompted = sum(usage["prompt_tokens"] for _, (_, usage, _) in results)
    assert metric(after, "fw_prompt_tokens_total", **labels) - metric(
        before, "fw_prompt_tokens_total", **labels) == prompted
    assert metric(after, "fw_e2e_request_latency_seconds_count", **labels) - metric(
        before, "fw_e2e_request_latency_seconds_count", **labels) == 64
    print(f"64 streams of <=16 tokens in {elapsed:.1f} s")


# -- clients that leave -------------------------------------------------------------------------


def _kv_usage(server) -> float:
    return metric(server.metrics_text(), "fw_kv_cache_usage_ratio")


def _running(server) -> float:
    return metric(server.metrics_text(), "fw_num_requests_running")


def test_client_gone_mid_stream_frees_its_kv_pages(server, model):
    wait_for(lambda: _kv_usage(server) == 0, 10, message="idle KV usage")
    body = {"model": model, "prompt": "Write a long story about a dragon.", "max_tokens": 400,
            "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            chunks = 0
            for line in lines:
                if line.startswith("data: "):
                    chunks += 1
                    if chunks == 3:
                        break
            assert _kv_usage(server) > 0
        # leaving the block closed the connection mid-stream
    left = time.monotonic()
    wait_for(lambda: _kv_usage(server) == 0 and _running(server) == 0, 5, message="KV usage back to 0")
    assert time.monotonic() - left < 5
    ok = httpx.post(server.url + "/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 3},
                    timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"]


def test_client_gone_during_a_non_streamed_request_aborts_it(server, model):
    """A non-streamed request whose client hung up must not keep generating (and holding pages)
    until max_tokens: 400 tokens take about 20 s here, the abort must come within a few."""
    wait_for(lambda: _kv_usage(server) == 0, 10, message="idle KV usage")
    body = {"model": model, "prompt": "Write a long story about a dragon.", "max_tokens": 400,
            "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.5))
    left = time.monotonic()
    wait_for(lambda: _kv_usage(server) == 0 and _running(server) == 0, 5, message="KV usage back to 0")
    assert time.monotonic() - left < 5
    ok = httpx.post(server.url + "/v1/chat/completions", json={"model": model, "messages": CAPITAL,
                                                               "max_tokens": 3}, timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"]


def test_curl_line_is_shell_quoted(server):
    """The printed line parses as one curl command with a JSON body (no stray quoting)."""
    line = next(ln for ln in server.stdout().splitlines() if ln.startswith("curl "))
    argv = shlex.split(line)
    body = json.loads(argv[argv.index("-d") + 1])
    assert body["model"] == "SmolLM2-135M-Instruct.Q4_1" and body["messages"][0]["role"] == "user"
