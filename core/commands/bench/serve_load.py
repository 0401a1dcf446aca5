"""Load generation and measurement against any OpenAI-compatible server.

Every request streams (`stream: true` with `stream_options.include_usage`), so
the client sees each chunk as the server sends it: the time of the first chunk
with content is the time to first token, the gaps between later content
chunks are the inter-token latencies. The parts that decide the numbers are
pure and tested on their own: `fw.commands.bench.sse` (bytes to `data:` payloads to
text/usage/error), `StreamRecorder` (payloads with
timestamps to a `RequestResult`) and `arrival_offsets` (the request schedule).
The rest wires them to httpx and asyncio.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import httpx

from fw.commands.bench import BenchError
from fw.commands.bench.sse import SSEDecoder, parse_chunk
from fw.commands.bench.prompts import (DEFAULT_TOKENS_PER_WORD, Calibration, calibrate, make_prompt, sample_lengths,
                              words_for_tokens)

CHAT = "chat"
COMPLETIONS = "completions"


@dataclass
class BenchConfig:
    """Everything a run depends on; stored in the JSON report so a result says how it was made."""

    base_url: str
    endpoint: str = "/v1/completions"
    model: str | None = None
    api_key: str | None = None
    num_prompts: int = 100
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    input_len: int = 128
    input_len_range: float = 0.0
    output_len: int = 128
    output_len_range: float = 0.0
    seed: int = 0
    temperature: float = 0.0
    ignore_eos: bool = False
    request_timeout: float = 600.0
    tokens_per_word: float | None = None  # None: calibrate with /tokenize, else 1.3
    extra_body: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        if self.num_prompts < 1:
            raise BenchError(f"--num-prompts must be at least 1, got {self.num_prompts}")
        if not self.request_rate > 0:
            raise BenchError(f"--request-rate must be positive (or inf), got {self.request_rate}")
        if not self.burstiness > 0:
            raise BenchError(f"--burstiness must be positive, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise BenchError(f"--max-concurrency must be at least 1, got {self.max_concurrency}")
        if not self.request_timeout > 0:
            raise BenchError(f"--request-timeout must be positive, got {self.request_timeout}")
        for name, mean, spread in (("input", self.input_len, self.input_len_range),
                                   ("output", self.output_len, self.output_len_range)):
            if mean < 1:
                raise BenchError(f"--{name}-len must be at least 1, got {mean}")
            if not 0 <= spread < 1:
                raise BenchError(f"--{name}-len-range must be in [0, 1), got {spread}")
        if self.tokens_per_word is not None and not self.tokens_per_word > 0:
            raise BenchError(f"--tokens-per-word must be positive, got {self.tokens_per_word}")

    @property
    def kind(self) -> str:
        return CHAT if self.endpoint.rstrip("/").endswith("chat/completions") else COMPLETIONS


def api_url(base_url: str, path: str) -> str:
    """Join base URL and path; a base URL that already ends in /v1 (the OpenAI SDK's habit) also works."""
    base = base_url.rstrip("/")
    if base.endswith("/v1") and path.startswith("/v1/"):
        base = base[: -len("/v1")]
    return base + "/" + path.lstrip("/")


def root_url(base_url: str) -> str:
    """Server root (where vLLM and fw serve /tokenize), with any trailing /v1 removed."""
    base = base_url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


# --- one request ---------------------------------------------------------------------------------------------


@dataclass
class RequestResult:
    """The measurements of one request. Times are seconds; `start` is since the run began."""

    index: int
    input_len: int  # the requested prompt length in tokens (the prompt is built to about this size)
    output_len: int  # max_tokens sent
    start: float = 0.0
    success: bool = False
    status_code: int | None = None
    error: str | None = None
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    latency: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None  # as the server's usage reported it
    output_tokens_source: str = "chunks"  # "usage" when the server's usage gave the count
    finish_reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class StreamRecorder:
    """Turns timestamped payloads of one stream into a RequestResult.

    The recorder is fed in arrival order with the monotonic time each payload's
    bytes arrived; it never reads a clock, so tests can drive it with made-up
    times.
    """

    def __init__(self, result: RequestResult, started: float) -> None:
        self.result = result
        self.started = started
        self._last_content: float | None = None
        self._content_chunks = 0
        self._usage_tokens: int | None = None
        self.done = False

    def feed(self, payload: str, now: float) -> bool:
        """Record one payload; True once the stream is over ([DONE] or an error)."""
        try:
            chunk = parse_chunk(payload)
        except ValueError as exc:
            self.result.error = f"bad stream payload: {exc}"
            self.done = True
            return True
        if chunk.error is not None:
            self.result.error = f"error in stream: {chunk.error}"
            self.done = True
            return True
        if chunk.done:
            self.done = True
            return True
        if chunk.text:
            if self._last_content is None:
                self.result.ttft = now - self.started
            else:
                self.result.itl.append(now - self._last_content)
            self._last_content = now
            self._content_chunks += 1
        if chunk.completion_tokens is not None:
            self._usage_tokens = int(chunk.completion_tokens)
        if chunk.prompt_tokens is not None:
            self.result.prompt_tokens = int(chunk.prompt_tokens)
        if chunk.finish_reason:
            self.result.finish_reason = chunk.finish_reason
        return False

    def finish(self, now: float) -> RequestResult:
        """Close the record: e2e latency, token count, success.

        A stream that closes without `[DONE]` still counts as a success when a
        choice finished (some servers omit `[DONE]`); otherwise it was cut off.
        """
        r = self.result
        r.latency = now - self.started
        if self._usage_tokens is not None:
            r.output_tokens, r.output_tokens_source = self._usage_tokens, "usage"
        else:
            r.output_tokens, r.output_tokens_source = self._content_chunks, "chunks"
        if r.error is None and not self.done and r.finish_reason is None:
            r.error = "stream ended before data: [DONE]"
        r.success = r.error is None
        return r


def error_message(status: int, body: bytes) -> str:
    """`HTTP 429: <message>` from an OpenAI-style error body, or from the raw text."""
    text = body.decode("utf-8", errors="replace")
    message = text.strip()
    try:
        obj = json.loads(text)
        if isinstance(obj, dict):
            err = obj.get("error", obj.get("detail", obj.get("message")))
            if isinstance(err, dict):
                err = err.get("message", err)
            if err is not None:
                message = str(err)
    except ValueError:
        pass
    return f"HTTP {status}: {message[:300]}" if message else f"HTTP {status}"


async def send_request(client: httpx.AsyncClient, url: str, payload: dict[str, Any], headers: dict[str, str],
                       result: RequestResult, clock_zero: float) -> RequestResult:
    """Stream one request, filling `result` in place (so a caller's timeout still has the start)."""
    started = time.perf_counter()
    result.start = started - clock_zero
    recorder = StreamRecorder(result, started)
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            result.status_code = resp.status_code
            if resp.status_code != 200:
                result.error = error_message(resp.status_code, await resp.aread())
                return recorder.finish(time.perf_counter())
            decoder = SSEDecoder()
            async for data in resp.aiter_bytes():
                now = time.perf_counter()
                if any(recorder.feed(p, now) for p in decoder.feed(data)):
                    break
            else:
                now = time.perf_counter()
                any(recorder.feed(p, now) for p in decoder.flush())
    except Exception as exc:  # noqa: BLE001 - one broken request is a failure to count, not the end of the run
        result.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return recorder.finish(time.perf_counter())


def build_payload(kind: str, model: str, prompt: str, max_tokens: int, temperature: float, ignore_eos: bool,
                  extra_body: dict[str, Any]) -> dict[str, Any]:
    """The request body. `ignore_eos` + `min_tokens` are vLLM's extensions (fw accepts them too) that make
    every request produce exactly `max_tokens`; keys in `extra_body` override, and a null value removes one
    (e.g. `{"stream_options": null}` for a server that rejects it)."""
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if kind == CHAT:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if ignore_eos:
        body["ignore_eos"] = True
        body["min_tokens"] = max_tokens
    for key, value in extra_body.items():
        if value is None:
            body.pop(key, None)
        else:
            body[key] = value
    return body


# --- the schedule and the run --------------------------------------------------------------------------------


def arrival_offsets(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Send times (seconds after the start) of `n` requests arriving at `rate` per second.

    Gaps are gamma-distributed with mean 1/rate; shape `burstiness` = 1 is the
    exponential, i.e. a Poisson process (independent arrivals, as from many
    users); below 1 is burstier, above 1 steadier. An infinite rate sends all
    at once. The first request goes at time 0.
    """
    if math.isinf(rate):
        return [0.0] * n
    offsets, t = [], 0.0
    for i in range(n):
        offsets.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return offsets


@dataclass
class PreparedRequest:
    index: int
    input_len: int
    output_len: int
    payload: dict[str, Any]


def prepare_requests(cfg: BenchConfig, model: str, tokens_per_word: float) -> list[PreparedRequest]:
    """The N requests, all decided by the seed before the first is sent."""
    rng = random.Random(cfg.seed)
    inputs = sample_lengths(cfg.input_len, cfg.input_len_range, cfg.num_prompts, rng)
    outputs = sample_lengths(cfg.output_len, cfg.output_len_range, cfg.num_prompts, rng)
    requests = []
    for i, (n_in, n_out) in enumerate(zip(inputs, outputs)):
        prompt = make_prompt(words_for_tokens(n_in, tokens_per_word), rng)
        payload = build_payload(cfg.kind, model, prompt, n_out, cfg.temperature, cfg.ignore_eos, cfg.extra_body)
        requests.append(PreparedRequest(i, n_in, n_out, payload))
    return requests


async def run_load(client: httpx.AsyncClient, url: str, headers: dict[str, str], requests: list[PreparedRequest],
                   offsets: list[float], max_concurrency: int | None, request_timeout: float,
                   on_done: Callable[[RequestResult], None] = lambda r: None) -> tuple[list[RequestResult], float]:
    """Send every request at its offset (waiting for a free slot under `max_concurrency`); return the
    results in request order and the wall time from the start until the last one ended."""
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    clock_zero = time.perf_counter()

    async def one(req: PreparedRequest, offset: float) -> RequestResult:
        delay = clock_zero + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if slots is None:
            result = await _with_timeout(req)
        else:
            async with slots:
                result = await _with_timeout(req)
        on_done(result)
        return result

    async def _with_timeout(req: PreparedRequest) -> RequestResult:
        result = RequestResult(req.index, req.input_len, req.output_len)
        try:
            return await asyncio.wait_for(send_request(client, url, req.payload, headers, result, clock_zero),
                                          request_timeout)
        except asyncio.TimeoutError:
            result.success = False
            result.error = f"timed out after {request_timeout:g} s"
            result.latency = time.perf_counter() - clock_zero - result.start
            return result

    results = await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets)))
    return list(results), time.perf_counter() - clock_zero


async def discover_model(client: httpx.AsyncClient, base_url: str, headers: dict[str, str]) -> str:
    """The first model id of `GET /v1/models`, the way the OpenAI SDK users find it."""
    url = api_url(base_url, "/v1/models")
    try:
        resp = await client.get(url, headers=headers)
    except httpx.HTTPError as exc:
        raise BenchError(f"cannot reach {url} ({type(exc).__name__}: {exc}); is the server up? "
                         f"Check --base-url") from None
    if resp.status_code != 200:
        raise BenchError(f"GET {url} answered {error_message(resp.status_code, resp.content)}; "
                         f"pass --model to skip the lookup")
    try:
        return str(resp.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise BenchError(f"GET {url} listed no model; pass --model") from None


_PHASE_SAMPLE = re.compile(r'^fw_startup_phase_seconds\{(.*)\}\s+(\S+)$')
_PHASE_LABEL = re.compile(r'(?:^|,)phase="((?:[^"\\]|\\.)*)"')
_READY_SAMPLE = re.compile(r'^fw_startup_ready_seconds(?:\{.*\})?\s+(\S+)$')


async def server_startup(client: httpx.AsyncClient, base_url: str, headers: dict[str, str]) -> dict | None:
    """A fw server's start-up phases from its /metrics (`fw_startup_phase_seconds`), for the report and the
    plot; None from any other server, or when /metrics does not answer."""
    try:
        resp = await client.get(root_url(base_url) + "/metrics", headers=headers, timeout=10.0)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    phases: dict[str, float] = {}
    ready = None
    for line in resp.text.splitlines():
        if m := _PHASE_SAMPLE.match(line):
            if label := _PHASE_LABEL.search(m.group(1)):
                name = re.sub(r"\\(.)", lambda e: "\n" if e.group(1) == "n" else e.group(1), label.group(1))
                phases[name] = float(m.group(2))
        elif m := _READY_SAMPLE.match(line):
            ready = float(m.group(1))
    return {"phases": phases, "ready_s": ready} if phases else None


@dataclass
class BenchmarkRun:
    """A finished run: per-request results, wall time, and what was decided before it started."""

    config: BenchConfig
    model: str
    calibration: Calibration
    results: list[RequestResult]
    duration: float
    server_startup: dict | None = None  # a fw server's start-up phases (its /metrics), else None


async def benchmark(cfg: BenchConfig, progress: bool = True) -> BenchmarkRun:
    """Discover the model, calibrate prompt lengths, send the load, collect the results."""
    cfg.validate()
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    connections = min(cfg.max_concurrency or cfg.num_prompts, cfg.num_prompts)
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    # httpx times each phase (connect, each read, ...); the run's own wait_for bounds the whole request.
    timeout = httpx.Timeout(cfg.request_timeout)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        model = cfg.model or await discover_model(client, cfg.base_url, headers)
        if cfg.tokens_per_word is not None:
            calibration = Calibration(cfg.tokens_per_word, "flag")
        else:
            calibration = await calibrate(client, root_url(cfg.base_url) + "/tokenize", model, headers, cfg.seed)
        startup = await server_startup(client, cfg.base_url, headers)
        requests = prepare_requests(cfg, model, calibration.tokens_per_word or DEFAULT_TOKENS_PER_WORD)
        offsets = arrival_offsets(cfg.num_prompts, cfg.request_rate, cfg.burstiness, random.Random(cfg.seed + 1))
        bar = _progress_bar(cfg.num_prompts, progress)
        try:
            results, duration = await run_load(client, api_url(cfg.base_url, cfg.endpoint), headers, requests,
                                               offsets, cfg.max_concurrency, cfg.request_timeout,
                                               on_done=lambda r: bar.update(1))
        finally:
            bar.close()
    return BenchmarkRun(cfg, model, calibration, results, duration, startup)


def _progress_bar(total: int, enabled: bool):
    from tqdm import tqdm  # a dependency of transformers and huggingface_hub, so always installed with fw

    return tqdm(total=total, disable=not enabled, file=sys.stderr, unit="req", desc="requests", leave=False)
