"""Per-request samplers through the server (the FastAPI app in process, over a tiny model with the
DRY and XTC plugins): requests naming DRY or XTC in `samplers` (and one with allowed_token_ids)
run concurrently with plain ones on both routes, share sampling steps, and every request gives
what it gives alone; invalid sampler parameters are 400s that name the sampler and the problem."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from conftest import make_llm
from fw.server.app import build_app
from fw.server.async_engine import AsyncEngine
from fw.server.config import ServerConfig
from fw.server.metrics import ServerMetrics
from fw.server.state import ServerState
from sampler_plugins import manager_with_sampler_plugins
from server_fixtures import assert_error_body

REPEATING = "The engine schedules every request"  # its plain greedy output repeats itself
DRY = {"name": "dry", "multiplier": 100.0, "sequence_breakers": []}
LEAST_LIKELY = {"name": "xtc", "threshold": 0.0, "probability": 1.0}
COMMON = {"temperature": 0, "max_tokens": 24, "ignore_eos": True}


def chat(text: str) -> dict:
    return {"messages": [{"role": "user", "content": text}]}


REQUESTS = [  # (route, body); index 0-4 completions, 5-6 chat
    ("completions", {"prompt": REPEATING}),
    ("completions", {"prompt": REPEATING, "samplers": [DRY]}),
    ("completions", {"prompt": "Hello world"}),
    ("completions", {"prompt": "Hello world", "samplers": [LEAST_LIKELY]}),
    ("completions", {"prompt": "Once upon a time", "temperature": 1.0, "seed": 3,
                     "samplers": [{"name": "xtc", "threshold": 0.02, "probability": 0.5}]}),
    ("chat/completions", chat(REPEATING)),
    ("chat/completions", {**chat(REPEATING), "samplers": [DRY, LEAST_LIKELY]}),
    ("completions", {"prompt": "Once upon a time", "allowed_token_ids": [40, 41, 42, 300]}),
    ("chat/completions", chat("Hello world")),
]


@pytest.fixture(scope="module")
def server(gqa_dir):
    """The app, and per sampling step the sampler names of each row."""
    llm = make_llm(gqa_dir, plugins=manager_with_sampler_plugins())
    engine = llm.engine
    steps: list[list[tuple[str, ...]]] = []
    sample = engine.sampler.sample

    def record(logits, batch, *args, **kwargs):
        steps.append([tuple(r.name for r in p.samplers) for p in batch.params])
        return sample(logits, batch, *args, **kwargs)

    engine.sampler.sample = record
    async_engine = AsyncEngine(engine)
    state = ServerState(async_engine, ServerConfig(), ["tiny"],
                        ServerMetrics("tiny", "sdpa", lambda: async_engine.stats))
    app = build_app(state)
    async_engine.start()
    yield app, steps
    asyncio.run(async_engine.drain(10.0))


async def post(client: httpx.AsyncClient, route: str, body: dict) -> httpx.Response:
    return await client.post(f"/v1/{route}", json={"model": "tiny", **COMMON, **body})


def text_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    return choice["text"] if "text" in choice else choice["message"]["content"]


def run(app, scenario):
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://tiny",
                                     timeout=60.0) as client:
            return await scenario(client)

    return asyncio.run(main())


def test_samplers_run_batched_with_plain_requests(server):
    app, steps = server

    async def scenario(client):
        alone = [text_of(await post(client, route, body)) for route, body in REQUESTS]
        steps.clear()
        together = await asyncio.gather(*(post(client, route, body) for route, body in REQUESTS))
        return alone, [text_of(r) for r in together]

    alone, together = run(app, scenario)
    assert together == alone  # plain greedy requests unchanged by their neighbours; seeded XTC reproducible
    assert alone[1] != alone[0]  # DRY changed the repeating continuation
    assert alone[3] != alone[2] and alone[6] != alone[5]  # XTC (threshold 0) took the least likely tokens
    mixed = [set(step) for step in steps]
    assert any({(), ("dry",), ("xtc",), ("dry", "xtc")} <= step for step in mixed), mixed[:5]


def test_invalid_sampler_requests_are_400s(server):
    app, _ = server

    async def scenario(client):
        return [await post(client, route, body) for route, body in [
            ("completions", {"prompt": "hi", "samplers": [{"name": "dry", "multiplier": -1}]}),
            ("chat/completions", {**chat("hi"), "samplers": [{"name": "xtc", "threshold": 0.1, "top": 2}]}),
            ("chat/completions", {**chat("hi"), "samplers": [{"name": "nope"}]}),
            ("completions", {"prompt": "hi", "samplers": "dry"}),
            ("completions", {"prompt": "hi", "samplers": [{"name": "dry"}, "dry"]}),
            ("completions", {"prompt": "hi", "allowed_token_ids": [3, 100000]}),
            ("completions", {"prompt": "hi", "samplers": ["dry"]}),  # the defaults: fine
        ]]

    responses = run(app, scenario)
    messages = [assert_error_body(r, 400)["message"] for r in responses[:-1]]
    assert messages[0] == "samplers: dry: multiplier: -1 is less than the minimum of 0"
    assert messages[1] == "samplers: xtc: Additional properties are not allowed ('top' was unexpected)"
    assert messages[2] == "samplers[0]: no per-request sampler named 'nope'; available: dry, xtc"
    assert messages[3].startswith("invalid request: samplers")
    assert messages[4] == "samplers: 'dry' is named twice; give each sampler once, with all its parameters"
    assert messages[5] == "allowed_token_ids: token id 100000 is outside the vocabulary (0..511)"
    assert all(r.json()["error"]["param"] in ("samplers", "allowed_token_ids") for r in responses[:-1])
    text_of(responses[-1])
