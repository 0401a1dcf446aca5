"""The engine on a background thread, driven from asyncio.

`LLMEngine` is synchronous and not thread-safe, so only the engine thread
touches it: request handlers send commands (add, abort, read stats) through
a queue and await their results; outputs flow back into per-request asyncio
queues. One request's failure (bad input, an abort) never disturbs another;
an engine fault fails the requests in flight, and the loop goes on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, TypeVar

import torch

from fw.engine.cpu_runtime import release_openmp_threads
from fw.engine.engine import LLMEngine
from fw.engine.outputs import RequestOutput
from fw.errors import DistributedError, FwError
from fw.lora.request import LoRARequest
from fw.sampling.params import SamplingParams

logger = logging.getLogger("fw.server")
T = TypeVar("T")


class EngineFaultError(FwError):
    """The engine raised while running a step; the requests in it are failed."""

    status_code = 500
    error_type = "internal_error"


_CLOSED = object()  # queued by RequestStream.close: the end of a stream cut short


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)

    def push(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def _thread_governor(engine: Any):
    """The CPU engine's ThreadGovernor (the generating engine's model runner's, or the encoder engine's); None
    on GPUs, with one thread, or with the CPU runtime tuning off."""
    runner = getattr(engine, "runner", None)
    return getattr(runner, "governor", None) or getattr(engine, "governor", None)


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for target, item in items:
        target.put_nowait(item)


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fw-engine", daemon=True)
        self._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fw-tokenizer")
        self.stats: dict[str, Any] = engine.stats()  # refreshed by the engine thread after each step
        self.dead: str | None = None  # why the engine can never step again (a lost rank); set once
        self.on_dead: Callable[[str], None] | None = None  # called on the engine thread when `dead` is set

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread. Called on the thread that loaded the model, whose OpenMP team is
        ended first: two teams on this machine's cores make every parallel op slow (fw.engine.cpu_runtime)."""
        self._num_threads = torch.get_num_threads()  # torch's thread count is per thread: carry it over
        release_openmp_threads()
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    async def drain(self, timeout: float) -> None:
        """Wait (bounded) for requests in flight to finish, then abort the rest and stop."""
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for request_id in list(self._streams):
            self.abort_nowait(request_id)
        self._stop.set()
        self._wake.set()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 5.0)

    def fail_streams(self, error: FwError) -> int:
        """End every stream in flight with `error` (its client gets an error event, not a cut
        connection) and abort its request; returns how many. Called on the event loop's thread."""
        failed = list(self._streams.items())
        for request_id, stream in failed:
            stream.push(error)
            self.abort_nowait(request_id)
        return len(failed)

    # -- requests ----------------------------------------------------------------------

    async def add_request(
        self,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        params: SamplingParams,
        request_id: str,
        lora_request: LoRARequest | None = None,
    ) -> "RequestStream":
        """Queue a request; validation errors are raised here, before any output is promised."""
        stream = _Stream(asyncio.get_running_loop())
        if getattr(params, "structured_outputs", None) is not None:  # embedding requests (PoolingParams) have none
            # Compile on the grammar service's worker, off the engine thread: the engine's own
            # compile in add_request is then a cache hit, and other requests keep stepping meanwhile.
            await asyncio.wrap_future(self.engine.grammar.compile_async(params.structured_outputs))

        def add() -> None:
            lora = {"lora_request": lora_request} if lora_request is not None else {}  # fw.lora: an adapter
            self.engine.add_request(request_id, prompt, prompt_token_ids, params, delta=True, **lora)
            self._streams[request_id] = stream

        await self._call(add)
        return RequestStream(self, request_id, stream, params.n)

    async def add_requests(self, prompts: list[tuple[str | None, list[int]]], params: Any,
                           request_ids: list[str]) -> list["RequestStream"]:
        """Queue several inputs in one command, all or nothing: the engine thread adds them between two
        steps, so they share the next batch (one `add_request` each would wait a step per input). For
        embedding requests, whose params hold no grammar to compile."""
        loop = asyncio.get_running_loop()
        streams = [_Stream(loop) for _ in prompts]

        def add() -> None:
            added: list[str] = []
            try:
                for (text, ids), request_id in zip(prompts, request_ids):
                    self.engine.add_request(request_id, text, ids, params, delta=True)
                    added.append(request_id)
            except BaseException:
                for request_id in added:
                    self.engine.abort_request(request_id)
                raise
            self._streams.update(zip(request_ids, streams))

        await self._call(add)
        return [RequestStream(self, request_id, stream) for request_id, stream in zip(request_ids, streams)]

    def abort_nowait(self, request_id: str) -> None:
        """Abort without awaiting: safe from `finally` blocks of cancelled tasks (disconnects)."""

        def abort() -> None:
            self._streams.pop(request_id, None)
            self.engine.abort_request(request_id)

        self._commands.put((abort, concurrent.futures.Future()))
        self._wake.set()

    async def abort(self, request_id: str) -> None:
        self.abort_nowait(request_id)

    async def on_engine_thread(self, work: Callable[[], T]) -> T:
        """Run `work` on the engine thread between two steps (loading an adapter, say) and await its result."""
        return await self._call(work)

    async def in_tokenizer_thread(self, work: Callable[[], T]) -> T:
        """Run `work` (a chat template, tokenizing) on the tokenizer's worker thread: on the event
        loop a long prompt stalls every stream, and tokenizers release the GIL while they split.
        On CPU the engine's steps leave that thread a core while it works (`ThreadGovernor.reserve_core`):
        a step's threads descheduled by it stalled a stream for 0.7 s during a 1.9 MB prompt."""
        governor = _thread_governor(self.engine)
        if governor is None:
            return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, work)

        def reserved() -> T:
            with governor.reserve_core():
                return work()

        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, reserved)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Tokenize on the tokenizer's worker thread (see `in_tokenizer_thread`)."""
        return await self.in_tokenizer_thread(
            lambda: self.engine.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    async def _call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine thread and await its result (or exception)."""
        if self.dead is not None:
            raise DistributedError(self.dead)
        if not self.alive:
            raise EngineFaultError("the engine is not running (shutting down, or it failed at start)")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, future))
        self._wake.set()
        return await asyncio.wrap_future(future)

    # -- the engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        torch.set_num_threads(self._num_threads)
        while not self._stop.is_set():
            self._wake.clear()
            if self._drain_commands():
                self.stats = self.engine.stats()  # an abort with nothing left to step must show too
            if not self.engine.has_unfinished_requests():
                self._wake.wait(timeout=1.0)
                if self._lost_rank_while_idle():
                    break
                continue
            try:
                outputs = self.engine.step()
            except DistributedError as exc:  # a lost rank: no step can run again
                self._die(exc)
                break
            except Exception as exc:  # keep serving: fail only the requests that were in the step
                logger.exception("engine step failed; failing %d request(s) in flight", len(self._streams))
                self._fail_all(EngineFaultError(f"the engine failed while running this request ({type(exc).__name__})"))
                continue
            self._deliver(outputs)
            self._fail_some()
            self.stats = self.engine.stats()
        self._drain_commands()

    def _fail_some(self) -> None:
        """Streams whose requests failed on their own (fw.distributed.data_parallel: their replica died)."""
        take = getattr(self.engine, "take_failures", None)
        for request_id, error in (take() if take is not None else ()):
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.push(error)

    def _lost_rank_while_idle(self) -> bool:
        """An idle engine learns of a dead worker from its cluster's watcher (within the 1 s idle wait),
        not only at the next request's step."""
        cluster = getattr(self.engine, "cluster", None)
        if cluster is None:
            return False
        try:
            cluster.raise_if_failed()
        except DistributedError as exc:
            self._die(exc)
            return True
        return False

    def _die(self, exc: DistributedError) -> None:
        """Fail every stream with `exc` (503, its message names the rank), mark the engine dead, tell `on_dead`."""
        logger.error("the engine cannot step any more; failing %d request(s) in flight: %s", len(self._streams), exc)
        self._fail_all(exc)
        self.dead = str(exc)
        self._stop.set()
        if self.on_dead is not None:
            self.on_dead(self.dead)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams with one wake-up of each event loop, not one per
        request: at 64 streams, per-output wake-ups cost the engine thread GIL hand-offs every step."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            batches.setdefault(stream.loop, []).append((stream.queue, out))
            if out.finished:
                del self._streams[out.request_id]
        for loop, items in batches.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _drain_commands(self) -> bool:
        """Run the queued commands; True if there were any (they may have changed the engine's state)."""
        ran = False
        while True:
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return ran
            ran = True
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

    def _fail_all(self, error: FwError) -> None:
        for request_id, stream in list(self._streams.items()):
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("abort of %s failed after an engine fault", request_id)
            stream.push(error)
        self._streams.clear()


class RequestStream:
    """One request's delta outputs. Closing it before the end aborts the request and frees its pages."""

    def __init__(self, engine: AsyncEngine, request_id: str, stream: _Stream, num_choices: int = 1):
        self.engine = engine
        self.request_id = request_id
        self._stream = stream
        self.num_choices = num_choices  # the request's n: choices that never produced output still count
        self.finished = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                item = await self._stream.queue.get()
                if item is _CLOSED:
                    return
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                self.finished = item.finished
                yield item
        finally:
            self.close()

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine.abort_nowait(self.request_id)
            # An aborted request gets no more outputs: wake a reader still waiting for one, so it
            # ends (and its metrics are recorded) instead of waiting forever.
            self._stream.queue.put_nowait(_CLOSED)
