"""Plumbing shared by the OpenAI routes: several prompts' streams merged into
one, server-sent events, and a response that always releases its admission
slot and aborts unfinished requests, however the client leaves."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator

from starlette.responses import StreamingResponse

from fw.engine.outputs import RequestOutput
from fw.errors import FwError
from fw.server.async_engine import RequestStream
from fw.server.protocol import error_body
from fw.server.state import ServerState

logger = logging.getLogger("fw.server")
_DONE = object()


async def add_all(state: ServerState, prompts: list[tuple[str | None, list[int]]], params,
                  request_id: str) -> list[RequestStream]:
    """Queue every prompt of a request, all or nothing."""
    streams: list[RequestStream] = []
    try:
        for i, (text, ids) in enumerate(prompts):
            streams.append(await state.add(text, ids, params, f"{request_id}-{i}"))
    except BaseException:
        for s in streams:
            s.close()
        raise
    return streams


async def merged(state: ServerState, streams: list[RequestStream],
                 prompt_lens: list[int]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, delta output) from all streams as they come."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in state.track(stream, prompt_lens[i]):
                await queue.put((i, out))
            await queue.put((i, _DONE))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.close()


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class EventStream(StreamingResponse):
    """SSE response that releases the request's admission slot and aborts its
    unfinished engine requests when it ends, including when it never started."""

    def __init__(self, state: ServerState, streams: list[RequestStream], events: AsyncIterator[str]):
        super().__init__(_with_errors(state, events), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._state = state
        self._streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for stream in self._streams:
                stream.close()
            self._state.release()


async def _with_errors(state: ServerState, events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Errors after the headers went out become an error event, then [DONE]."""
    try:
        async for event in events:
            yield event
    except FwError as exc:
        state.metrics.error(exc.status_code)
        yield sse(error_body(str(exc), exc.error_type, exc.status_code))
    except Exception:
        logger.exception("stream failed")
        state.metrics.error(500)
        yield sse(error_body("internal error while streaming; see the server log", "internal_error", 500))
    yield "data: [DONE]\n\n"
