"""POST /v1/embeddings (OpenAI's API), and the task check the generation routes make.

A server runs one task (--task): a model served for embeddings refuses /v1/completions and
/v1/chat/completions, and one served for generation refuses /v1/embeddings, each with a 400 that
says which task the model serves and how to get the other. Every input of a request is added to
the engine in one command, so they share its next batch; the answer waits for all of them."""

from __future__ import annotations

import asyncio
import base64
import time

import numpy as np
from fastapi import APIRouter, Request

from fw.errors import InvalidRequestError
from fw.pooling.params import PoolingParams
from fw.server.openapi import error_responses
from fw.server.protocol import EmbeddingRequest, new_id, now
from fw.server.state import ServerState
from fw.server.streaming import unless_disconnected

router = APIRouter()

MAX_INPUTS = 2048  # inputs in one request: OpenAI's limit
ENCODINGS = ("float", "base64")


def engine_task(state: ServerState) -> str:
    """What the served engine does: "embed" (an encoder, or a decoder under --task embed) or "generate"."""
    return "embed" if state.pooling is not None else "generate"


def require_task(state: ServerState, task: str, route: str) -> None:
    """A 400 naming the model's task when `route` needs the other one."""
    if engine_task(state) == task:
        return
    name = state.served_names[0]
    if task == "generate":
        raise InvalidRequestError(
            f"{route}: the model `{name}` is served for embeddings (task embed): it answers /v1/embeddings, not "
            f"text generation" + ("" if _is_encoder(state) else "; start the server without --task embed to "
                                  "generate with it"), param="model")
    raise InvalidRequestError(
        f"{route}: the model `{name}` is served for text generation and cannot embed as served; start the "
        f"server with --task embed (and --pooling last|mean) to serve embeddings from it", param="model")


def _is_encoder(state: ServerState) -> bool:
    return state.architecture_task == "embed"


def _inputs(value) -> list[str | list[int]]:
    """The request's inputs, each a non-empty string or a non-empty list of token ids."""
    if isinstance(value, str):
        value = [value]
    elif value and all(isinstance(t, int) for t in value):
        value = [list(value)]
    if not value:
        raise InvalidRequestError("input must not be empty", param="input")
    if len(value) > MAX_INPUTS:
        raise InvalidRequestError(f"input has {len(value)} items; at most {MAX_INPUTS} per request",
                                  param="input")
    for item in value:
        if not item:
            raise InvalidRequestError("each input must be a non-empty string or a non-empty list of token ids",
                                      param="input")
    return list(value)


@router.post("/v1/embeddings", responses=error_responses(400, 401, 404, 413, 429, 500, 503))
async def create_embedding(req: EmbeddingRequest, request: Request):
    state: ServerState = request.app.state.fw
    model = state.model_name(req.model)
    state.note_ignored(req)
    require_task(state, "embed", "/v1/embeddings")
    if req.encoding_format not in ENCODINGS:
        raise InvalidRequestError(f"encoding_format must be one of {', '.join(ENCODINGS)}, got "
                                  f"{req.encoding_format!r}", param="encoding_format")
    inputs = _inputs(req.input)
    params = PoolingParams(dimensions=req.dimensions)
    state.pooling.check_dimensions(params.dimensions, f"the model `{model}`")
    with state.admission() as permit:  # before tokenizing: a busy server refuses at once
        try:
            prompts = await _tokenized(state, inputs)
            request_id = new_id("embd")
            ids = [f"{request_id}-{i}" for i in range(len(prompts))]
            arrival = time.monotonic()
            streams = await state.engine.add_requests(prompts, params, ids)
            try:
                outputs = await unless_disconnected(request, _collect(streams))
            finally:
                for stream in streams:
                    stream.close()  # a no-op for finished requests; aborts any left by a client gone
        finally:
            permit.release()
    tokens = sum(len(ids) for _, ids in prompts)
    state.metrics.request_finished(["stop"] * len(outputs), tokens, 0, time.monotonic() - arrival)
    data = [{"object": "embedding", "index": i, "embedding": _encoded(out.outputs.embedding, req.encoding_format)}
            for i, out in enumerate(outputs)]
    return {"id": request_id, "object": "list", "created": now(), "model": model, "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


async def _tokenized(state: ServerState, inputs: list[str | list[int]]) -> list[tuple[str | None, list[int]]]:
    """Text inputs tokenized in one call on the tokenizer's thread (their byte size checked first);
    token-id inputs as given."""
    texts = [i for i, item in enumerate(inputs) if isinstance(item, str)]

    def work() -> list[list[int]]:
        for i in texts:
            state.prompt_limits.check_bytes(inputs[i], "input")
        return state.tokenizer([inputs[i] for i in texts]).input_ids if texts else []

    encoded = dict(zip(texts, await state.engine.in_tokenizer_thread(work)))
    return [(item, encoded[i]) if i in encoded else (None, list(item)) for i, item in enumerate(inputs)]


async def _collect(streams) -> list:
    async def one(stream):
        async for out in stream:
            if out.finished:
                return out

    return await asyncio.gather(*(one(s) for s in streams))


def _encoded(vector: list[float], encoding: str) -> list[float] | str:
    """float: the list; base64: the little-endian float32 bytes, as OpenAI sends them (its SDK asks for
    base64 and decodes with numpy)."""
    if encoding == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
