"""`fw bench serve`: whole runs against a small OpenAI-compatible FastAPI app on 127.0.0.1 whose
stream timing is known, so the measured TTFT, ITL, TPOT and throughput can be checked against it,
and one run against a real `fw serve`. The pure parts are in test_bench_units.py."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from fw.commands.bench import BenchError
from fw.commands.bench.report import build_report, format_table
from fw.commands.bench.serve_load import BenchConfig, arrival_offsets, benchmark
from fw.cli.main import main


# --- whole runs against a fake server ---------------------------------------------------------------------------

TTFT, ITL = 0.10, 0.05  # the fake server's prefill and per-chunk delays, in seconds


def fake_openai_app(*, tokens_per_chunk: int = 1, usage: bool = True, fail_every: int = 0,
                    tokenize: bool = True, stall: float = 0.0) -> tuple[FastAPI, dict]:
    """An OpenAI-compatible streaming server with known timing: the first chunk after TTFT, then one
    chunk every ITL, max_tokens / tokens_per_chunk chunks in all. Every `fail_every`-th request is
    refused with 429. `state` records what it saw (prompts, concurrency)."""
    app = FastAPI()
    state = {"requests": 0, "inflight": 0, "max_inflight": 0, "bodies": []}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    if tokenize:
        @app.post("/tokenize")
        async def tokenize_(request: Request):
            words = (await request.json())["prompt"].split()
            return {"tokens": list(range(len(words) + 1)), "count": len(words) + 1}  # 1 token/word + BOS

    async def handle(request: Request, chat: bool):
        body = await request.json()
        state["requests"] += 1
        state["bodies"].append(body)
        if fail_every and state["requests"] % fail_every == 0:
            return JSONResponse({"error": {"message": "too many requests", "type": "rate_limit_error"}},
                                status_code=429)
        chunks = max(1, body["max_tokens"] // tokens_per_chunk)

        def event(text: str | None, finish: str | None = None) -> str:
            choice = ({"index": 0, "delta": {"content": text} if text is not None else {"role": "assistant"}}
                      if chat else {"index": 0, "text": text or ""})
            choice["finish_reason"] = finish
            return "data: " + json.dumps({"id": "x", "object": "chunk", "model": body["model"],
                                          "choices": [choice]}) + "\n\n"

        async def stream():
            state["inflight"] += 1
            state["max_inflight"] = max(state["max_inflight"], state["inflight"])
            try:
                if chat:
                    yield event(None)  # the role chunk: no content, must not count as the first token
                await asyncio.sleep(TTFT + stall)
                for i in range(chunks):
                    if i:
                        await asyncio.sleep(ITL)
                    yield event("tok" * tokens_per_chunk, "length" if i == chunks - 1 else None)
                if usage:
                    yield "data: " + json.dumps({"choices": [], "usage": {
                        "prompt_tokens": len(str(body.get("prompt", body.get("messages"))).split()),
                        "completion_tokens": chunks * tokens_per_chunk}}) + "\n\n"
                yield "data: [DONE]\n\n"
            finally:
                state["inflight"] -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app, state


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(app: FastAPI) -> Iterator[str]:
    """Run `app` with uvicorn in a thread on a free loopback port; yield its base URL."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def run_bench(cfg: BenchConfig) -> dict:
    return build_report(asyncio.run(benchmark(cfg, progress=False)))


def test_measures_the_servers_timing_and_counts_429s():
    app, state = fake_openai_app(tokens_per_chunk=2, fail_every=4)
    with serving(app) as url:
        report = run_bench(BenchConfig(url, num_prompts=8, max_concurrency=4, input_len=20, output_len=10))
    assert report["model"] == "fake-model"  # from GET /v1/models
    assert (report["completed"], report["failed"]) == (6, 2)
    assert report["errors"] == {"HTTP 429: too many requests": 2}
    assert {r["status_code"] for r in report["requests"] if not r["success"]} == {429}
    assert state["max_inflight"] <= 4 and report["max_concurrent_requests"] <= 4

    # /tokenize says 1 token per word (+ BOS): prompts of 20 tokens are 20 words
    assert (report["tokens_per_word"], report["tokens_per_word_source"]) == (1.0, "tokenize")
    assert {len(b["prompt"].split()) for b in state["bodies"]} == {20}
    assert all(b["stream"] and b["stream_options"] == {"include_usage": True} and b["temperature"] == 0
               for b in state["bodies"])

    # 5 chunks of 2 tokens: TTFT, then 4 gaps of ITL. The server sleeps, so these are hard lower bounds;
    # a loaded CI machine only stretches them, so the upper bounds are loose and the exact checks are
    # structural: each request's TTFT + ITLs add up to its E2E latency, and TPOT is derived from them.
    ms, slow = 1000, 4.0
    ok = [r for r in report["requests"] if r["success"]]
    for r in ok:
        assert len(r["itl"]) == 4 and r["output_tokens"] == 10
        assert r["ttft"] >= TTFT and min(r["itl"]) >= ITL * 0.9
        assert r["ttft"] + sum(r["itl"]) <= r["latency"] + 1e-9
        assert r["latency"] - r["ttft"] - sum(r["itl"]) < 2 * ITL  # E2E ends at the last token, not long after
    assert TTFT * ms <= report["ttft_ms"]["median"] < TTFT * ms * slow
    assert ITL * ms * 0.9 <= report["itl_ms"]["median"] < ITL * ms * slow
    assert report["output_tokens_source"] == "usage" and report["total_output_tokens"] == 60
    tpots = sorted((r["latency"] - r["ttft"]) / 9 * ms for r in ok)
    assert report["tpot_ms"]["median"] == pytest.approx((tpots[2] + tpots[3]) / 2)
    assert 4 * ITL * ms / 9 * 0.9 <= report["tpot_ms"]["median"]
    e2e = TTFT + 4 * ITL
    assert e2e * ms <= report["e2el_ms"]["median"] < e2e * ms * slow
    # two waves of at most 4 (the refused ones free their slot at once)
    assert 2 * e2e * 0.95 <= report["duration_s"] < 2 * e2e * slow
    assert report["request_throughput"] == pytest.approx(6 / report["duration_s"])
    assert report["output_throughput"] == pytest.approx(60 / report["duration_s"])
    assert report["total_token_throughput"] == pytest.approx(
        (report["total_input_tokens"] + 60) / report["duration_s"])
    assert report["input_tokens_source"] == "usage" and report["total_input_tokens"] == 6 * 20


def test_cli_chat_without_usage_or_tokenize_writes_the_json(tmp_path, capsys):
    app, state = fake_openai_app(usage=False, tokenize=False)
    out = tmp_path / "result.json"
    with serving(app) as url:
        code = main(["bench", "serve", "--base-url", url + "/v1", "--endpoint", "/v1/chat/completions",
                     "--model", "my-model", "--api-key", "secret", "--num-prompts", "6", "--request-rate", "inf",
                     "--input-len", "26", "--output-len", "4", "--output-len-range", "0.5", "--ignore-eos",
                     "--seed", "3", "--result-json", str(out), "--no-progress"])
    assert code == 0
    table = capsys.readouterr().out
    for line in ("Successful requests:", "Request throughput (req/s):", "Output token throughput (tok/s):",
                 "Total token throughput (tok/s):", "Mean TTFT (ms):", "P99 TPOT (ms):", "Median ITL (ms):",
                 "P90 E2EL (ms):"):
        assert line in table
    report = json.loads(out.read_text())
    for key in ("completed", "failed", "duration_s", "request_throughput", "output_throughput",
                "total_token_throughput", "total_input_tokens", "total_output_tokens", "errors", "requests",
                "config", "model"):
        assert key in report
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert set(report[metric]) >= {"mean", "median", "p90", "p99"}
        assert all(isinstance(v, float) for v in report[metric].values())
    assert "api_key" not in report["config"] and "secret" not in out.read_text()
    assert report["config"]["request_rate"] == "inf"
    assert (report["completed"], report["model"], report["tokens_per_word_source"]) == (6, "my-model", "default")
    # no usage chunk: tokens are counted as content chunks (the role chunk is not one); 26 tokens / 1.3 = 20 words
    assert report["output_tokens_source"] == "chunks" and report["input_tokens_source"] == "estimate"
    max_tokens = [b["max_tokens"] for b in state["bodies"]]
    assert all(2 <= m <= 6 for m in max_tokens)
    assert report["total_output_tokens"] == sum(max_tokens)
    assert all(b["ignore_eos"] is True and b["min_tokens"] == b["max_tokens"] for b in state["bodies"])
    assert {len(b["messages"][0]["content"].split()) for b in state["bodies"]} == {20}
    assert report["ttft_ms"]["min"] >= TTFT * 1000
    assert report["max_concurrent_requests"] == 6  # all at once


def test_request_rate_spreads_the_starts():
    app, _ = fake_openai_app()
    with serving(app) as url:
        report = run_bench(BenchConfig(url, model="m", num_prompts=6, request_rate=20.0, input_len=4, output_len=2,
                                       seed=5))
    expected = arrival_offsets(6, 20.0, 1.0, random.Random(5 + 1))
    starts = [r["start"] for r in report["requests"]]
    assert all(0 <= s - e < 0.5 for s, e in zip(starts, expected)), (starts, expected)  # late only on a loaded machine


def test_timeouts_are_failures_and_the_run_still_ends():
    app, _ = fake_openai_app(stall=5.0)
    with serving(app) as url:
        t0 = time.monotonic()
        report = run_bench(BenchConfig(url, model="m", num_prompts=3, input_len=4, output_len=2,
                                       request_timeout=0.3))
    assert time.monotonic() - t0 < 3
    assert (report["completed"], report["failed"]) == (0, 3)
    assert report["errors"] == {"timed out after 0.3 s": 3}
    assert report["ttft_ms"]["mean"] is None and report["request_throughput"] == 0
    assert "Failed requests:" in format_table(report)


def test_unreachable_server_is_one_line_error(capsys):
    port = free_port()  # nothing listens there
    assert main(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "1",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fw: error: cannot reach") and "--base-url" in err and "Traceback" not in err
    with pytest.raises(BenchError):
        BenchConfig("u", max_concurrency=0).validate()
    assert main(["bench", "serve", "--input-len-range", "1.5", "--model", "m", "--no-progress"]) == 2


# --- against the real `fw serve` ---------------------------------------------------------------------------------


@pytest.fixture
def fw_server(gqa_dir, tmp_path) -> Iterator[str]:
    """`fw serve` on the tiny GQA model, as its own process (the way a user runs it); yields its URL.
    Its output goes to a file (a pipe nobody reads could fill and stall the server)."""
    import subprocess
    import sys

    import httpx

    from plugin_fixtures import clean_env

    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "fw.cli.main", "serve", "--model", str(gqa_dir), "--port",
                                 str(port), "--num-kv-blocks", "64"], env=clean_env(), stdout=sink,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"fw serve exited: {log.read_text(errors='replace')}"
            assert time.monotonic() < deadline, "fw serve did not come up in 60 s"
            try:
                if httpx.get(url + "/v1/models", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_against_fw_serve(fw_server, tmp_path, capsys):
    pytest.importorskip("matplotlib")  # the PNG plot: the bench extra (the test extra has it)
    from fw.commands.bench.plot import read_png_data

    out, plot = tmp_path / "fw.json", tmp_path / "fw.png"
    assert main(["bench", "serve", "--base-url", fw_server, "--num-prompts", "8", "--max-concurrency", "4",
                 "--input-len", "32", "--output-len", "8", "--ignore-eos", "--no-progress",
                 "--result-json", str(out), "--plot", str(plot)]) == 0
    report = json.loads(out.read_text())
    ttft, itl, e2e, startup = read_png_data(plot)["panels"]  # what the PNG shows is what the report says
    assert ttft["data"]["values"] == pytest.approx([r["ttft"] * 1000 for r in report["requests"]])
    assert e2e["data"]["markers"]["p99"] == report["e2el_ms"]["p99"]
    assert sum(b[2] for b in itl["data"]["bins"]) == sum(len(r["itl"]) for r in report["requests"])
    # fw's /metrics gives its start-up phases, stacked in the plot
    phases = report["server_startup"]["phases"]
    assert "load weights" in phases and report["server_startup"]["ready_s"] > 0
    assert {layer["label"] for layer in startup["data"]["layers"]} == set(phases)
    assert (report["completed"], report["failed"]) == (8, 0), report["errors"]
    assert report["total_output_tokens"] == 64 and report["output_tokens_source"] == "usage"
    assert report["tokens_per_word_source"] == "tokenize"  # fw serves POST /tokenize
    assert report["max_concurrent_requests"] <= 4
    # at most one content chunk per token (a token that ends inside a UTF-8 character streams no text)
    assert all(r["ttft"] is not None and len(r["itl"]) <= 7 for r in report["requests"])
    assert "Successful requests:" in capsys.readouterr().out
