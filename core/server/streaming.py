"""Plumbing shared by the OpenAI routes: several prompts' streams merged into
one, server-sent events, and a response that always releases its admission
slot and aborts unfinished requests, however the client leaves."""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import aclosing
from typing import Any, AsyncIterator, Awaitable, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from fw.engine.outputs import RequestOutput
from fw.errors import FwError
from fw.server.async_engine import RequestStream
from fw.server.protocol import error_body
from fw.server.state import Permit, ServerState

logger = logging.getLogger("fw.server")
_DONE = object()
T = TypeVar("T")


class ClientDisconnectedError(FwError):
    """The client hung up before its (non-streamed) answer was ready; nobody reads this reply."""

    status_code = 499
    error_type = "client_closed_request"


async def add_all(state: ServerState, prompts: list[tuple[str | None, list[int]]], params,
                  request_id: str, lora_request=None) -> list[RequestStream]:
    """Queue every prompt of a request, all or nothing."""
    streams: list[RequestStream] = []
    try:
        for i, (text, ids) in enumerate(prompts):
            streams.append(await state.add(text, ids, params, f"{request_id}-{i}", lora_request))
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
            # closed at once when the pump is cancelled, so the request's metrics are recorded then
            async with aclosing(state.track(stream, prompt_lens[i])) as outputs:
                async for out in outputs:
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


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await a non-streamed request's `work`, cancelling it if the client hangs up first.

    Nothing else notices a vanished client until the answer is written, so without this a request
    would keep its pages and batch slot, generating up to max_tokens for nobody. Cancelling `work`
    runs its `finally` blocks, which abort its engine requests."""
    task = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
        if task.done() or listener.exception() is not None:
            return await task
    finally:
        listener.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    raise ClientDisconnectedError("the client closed the connection before the answer was ready")


async def _disconnect(request: Request) -> None:
    """Return once the client disconnects (the body was read: receive() has nothing else to give)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def respond(state: ServerState, request: Request, permit: Permit, stream: bool,
                  prompts: list[tuple[str | None, list[int]]], params, request_id: str, job,
                  lora_request=None) -> Response:
    """Queue an admitted request's prompts, then answer: SSE events (`job.events`) or the
    collected JSON (`job.collect`). The admission `permit` is released and unfinished engine
    requests are aborted however the answer ends."""
    try:
        streams = await add_all(state, prompts, params, request_id, lora_request)
    except BaseException:
        permit.release()
        raise
    if stream:
        return EventStream(state, permit, streams, job.events(streams))
    try:
        return JSONResponse(await unless_disconnected(request, job.collect(streams)))
    finally:
        for s in streams:
            s.close()  # a no-op for finished requests; aborts any left by a cancelled collect
        permit.release()


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class EventStream(StreamingResponse):
    """SSE response that releases the request's admission slot and aborts its
    unfinished engine requests when it ends, including when it never started."""

    def __init__(self, state: ServerState, permit: Permit, streams: list[RequestStream],
                 events: AsyncIterator[str]):
        super().__init__(_with_errors(state, events), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._permit = permit
        self._streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for stream in self._streams:
                stream.close()
            self._permit.release()


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
