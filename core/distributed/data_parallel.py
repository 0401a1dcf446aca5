"""Data parallelism: N engine replicas behind one server, each request routed to the least loaded one.

Replica 0 is the server's own engine (in the server's process: its tokenizer, grammar compiler and
model facts answer the routes); replicas 1..N-1 are spawned processes, each running an `LLMEngine`
(itself a tensor-parallel group with --tp > 1) in a loop of its own, fed through a pipe: requests and
aborts go in, each step's outputs come back. A request goes to the live replica with the fewest tokens
still to process (prompt + max_tokens - generated, over its requests in flight), ties in turn. A
replica that dies fails only its own requests (a 503 error each, naming it) and is routed around;
only when none is left does the engine fail as a whole (the server then exits, fw.server.async_engine).

The pipe carries pickled Python objects (SamplingParams, RequestOutput) between processes of one
machine that this process started: unlike the tensor-parallel step broadcast, nothing crosses a
network. Replicas share no KV cache: the same prefix sent to two replicas is computed twice."""

from __future__ import annotations

import atexit
import dataclasses
import logging
import multiprocessing.connection
import os
import time
from dataclasses import dataclass, field

import torch.multiprocessing as mp

from fw.config import EngineConfig
from fw.distributed.processes import STOP_WAIT_S, describe_exit, stop_processes
from fw.distributed.threads import bind_rank
from fw.errors import ConfigError, DistributedError, FwError

logger = logging.getLogger("fw.distributed")

_POLL_S = 0.02  # how long a step with only other replicas' requests waits for their outputs


def check_data_parallel(config: EngineConfig) -> None:
    """--data-parallel-size with the options it cannot combine with (on one machine, behind `fw serve`)."""
    dp = config.data_parallel_size
    if dp == 1:
        return
    if config.nnodes > 1:
        raise ConfigError(f"--data-parallel-size {dp}: replicas run on one machine; drop --nnodes "
                          f"(or run one fw serve per machine behind a load balancer)")
    if config.dist_init_addr:
        raise ConfigError(f"--data-parallel-size {dp}: each replica's tensor-parallel group picks its own "
                          f"loopback port; drop --dist-init-addr")
    if config.enable_lora:
        raise ConfigError(f"--data-parallel-size {dp}: LoRA adapters are loaded into one engine; drop "
                          f"--enable-lora or use --data-parallel-size 1")


# -- a replica process ---------------------------------------------------------------------------


def run_replica(config: EngineConfig, index: int, conn) -> None:
    """A spawned replica's main: load the engine, say so, then step and answer the pipe until told to
    stop or the server is gone (a closed pipe, or its parent process ended)."""
    from fw.distributed.worker import _exit_with_parent  # here: only the spawned replica runs an engine
    from fw.engine.factory import create_engine  # here: the server's process starts replicas, it loads no engine itself

    _exit_with_parent()
    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s replica {index} %(name)s: %(message)s")
    code = 1
    try:
        if config.tensor_parallel_size == 1:
            bind_rank(index, config.data_parallel_size, config.num_threads)
        engine = create_engine(dataclasses.replace(config, data_parallel_size=1))
        conn.send(("ready", engine.stats()))
        _serve(engine, conn)
        code = 0
    except (EOFError, BrokenPipeError):
        code = 0  # the server closed the pipe: it is gone or stopping
    except BaseException as exc:
        message = str(exc) if isinstance(exc, FwError) else f"{type(exc).__name__}: {exc}"
        logger.error("replica %d failed: %s", index, message)
        try:
            conn.send(("failed", message))
        except Exception:
            pass
    finally:
        logging.shutdown()
        os._exit(code)


def _serve(engine, conn) -> None:
    while True:
        busy = engine.has_unfinished_requests()
        if busy or conn.poll(1.0):
            while conn.poll(0):
                message = conn.recv()
                if message[0] == "stop":
                    return
                if message[0] == "abort":
                    engine.abort_request(message[1])
                    continue
                _, request_id, ids, params = message
                try:
                    engine.add_request(request_id, None, ids, params, delta=True)
                except FwError as exc:
                    conn.send(("rejected", request_id, type(exc).__name__, exc.status_code, exc.error_type, str(exc)))
        if engine.has_unfinished_requests():
            outputs = engine.step()
            conn.send(("outputs", outputs, engine.stats()))


# -- the server's side ---------------------------------------------------------------------------


class ReplicaError(FwError):
    """A request failed because its data-parallel replica failed (or refused it there)."""

    status_code = 503
    error_type = "service_unavailable"


@dataclass
class _InFlight:
    replica: int
    tokens: int  # prompt + max_tokens - generated: what the replica has still to process for it


@dataclass
class Replica:
    index: int
    proc: mp.Process | None = None  # None: the server's own engine
    conn: object = None
    failure: str | None = None
    stats: dict = field(default_factory=dict)
    served: int = 0  # requests routed here (the tests check that the load spread)

    @property
    def alive(self) -> bool:
        return self.failure is None


class DataParallelEngine:
    """The replicas, seen as one engine by the server's engine thread (fw.server.async_engine): the same
    add_request / abort_request / step / stats calls as `LLMEngine`; anything else (the tokenizer, the
    grammar compiler, model facts) is replica 0's."""

    def __init__(self, local, replicas: list[Replica], config: EngineConfig):
        self.local, self.config = local, config
        self.replicas = replicas
        self._in_flight: dict[str, _InFlight] = {}
        self._failures: list[tuple[str, FwError]] = []
        self._turn = 0
        self.closed = False
        atexit.register(self.close)

    @classmethod
    def start(cls, config: EngineConfig, make_engine) -> "DataParallelEngine":
        """Spawn replicas 1..N-1 (they load while this process loads replica 0 with `make_engine(config)`),
        then wait for each to be ready, at most --dist-init-timeout; a replica that fails says why."""
        check_data_parallel(config)
        context = mp.get_context("spawn")
        replicas = [Replica(0)]
        for index in range(1, config.data_parallel_size):
            mine, theirs = context.Pipe()
            proc = context.Process(target=run_replica, args=(config, index, theirs), name=f"fw-dp-replica{index}")
            proc.start()
            theirs.close()
            replicas.append(Replica(index, proc, mine))
        try:
            single = dataclasses.replace(config, data_parallel_size=1)
            if config.tensor_parallel_size == 1:
                unbind = bind_rank(0, config.data_parallel_size, config.num_threads)
                atexit.register(unbind)
            local = make_engine(single)
            if getattr(local, "pooling", None) is not None or not hasattr(local, "scheduler"):
                raise ConfigError(f"--data-parallel-size {config.data_parallel_size}: replicas serve text "
                                  f"generation; an embedding model runs one engine (--data-parallel-size 1)")
            engine = cls(local, replicas, config)
            for replica in replicas[1:]:
                _wait_ready(replica, config.dist_init_timeout)
        except BaseException:
            stop_processes({r.index: r.proc for r in replicas[1:]}, 0.0)
            raise
        logger.info("data parallel: %d replicas ready", len(replicas))
        return engine

    def __getattr__(self, name: str):
        return getattr(self.local, name)

    # -- requests ------------------------------------------------------------------------

    def add_request(self, request_id: str | None = None, prompt: str | None = None,
                    prompt_token_ids: list[int] | None = None, params=None, delta: bool = False, **extra):
        """Route to the live replica with the fewest tokens in flight (ties in turn)."""
        if extra.get("lora_request") is not None:
            raise ConfigError("LoRA adapters do not run with --data-parallel-size > 1")
        if params is None or not hasattr(params, "max_tokens"):  # embeddings: replica 0 (small, one step)
            return self.local.add_request(request_id, prompt, prompt_token_ids, params, delta=delta)
        ids = prompt_token_ids if prompt_token_ids is not None else self.local.tokenize(prompt)
        request_id = request_id or self.local.new_request_id()
        tokens = len(ids) + (params.max_tokens or 0) * max(1, getattr(params, "n", 1) or 1)
        while True:
            target = self._choose()
            if target.proc is None:
                request = self.local.add_request(request_id, prompt, ids, params, delta=delta)
                break
            try:
                target.conn.send(("add", request_id, ids, params))
                request = None
                break
            except OSError:  # it died since the last step: route around it
                self._lose(target, f"data-parallel replica {target.index} (pid {target.proc.pid}) "
                                   f"{describe_exit(target.proc.exitcode if not target.proc.is_alive() else None)}")
        self._in_flight[request_id] = _InFlight(target.index, tokens)
        target.served += 1
        return request

    def _choose(self) -> Replica:
        for replica in self.replicas[1:]:  # one that died while the engine was idle
            if replica.alive and not replica.proc.is_alive():
                self._lose(replica, f"data-parallel replica {replica.index} (pid {replica.proc.pid}) "
                                    f"{describe_exit(replica.proc.exitcode)}")
        live = [r for r in self.replicas if r.alive]
        if not live:
            raise DistributedError(self._all_lost())
        load = {r.index: 0 for r in live}
        for item in self._in_flight.values():
            if item.replica in load:
                load[item.replica] += item.tokens
        least = min(load.values())
        tied = [r for r in live if load[r.index] == least]
        self._turn += 1
        return tied[self._turn % len(tied)]

    def abort_request(self, request_id: str):
        item = self._in_flight.pop(request_id, None)
        if item is None or item.replica == 0:
            return self.local.abort_request(request_id)
        replica = self.replicas[item.replica]
        if replica.alive:
            try:
                replica.conn.send(("abort", request_id))
            except OSError:
                pass
        return None

    def has_unfinished_requests(self) -> bool:
        return bool(self._in_flight) or bool(self._failures) or self.local.has_unfinished_requests()

    # -- stepping ------------------------------------------------------------------------

    def step(self) -> list:
        outputs = []
        local = self.replicas[0]
        if local.alive and self.local.has_unfinished_requests():
            try:
                outputs += self.local.step()
            except DistributedError as exc:  # replica 0's tensor-parallel group lost a rank
                self._lose(local, str(exc))
        outputs += self._poll(0.0 if outputs else _POLL_S)
        for out in outputs:
            item = self._in_flight.get(out.request_id)
            if item is None:
                continue
            if out.finished:
                del self._in_flight[out.request_id]
            else:
                item.tokens -= sum(len(c.token_ids) for c in out.outputs)
        if not any(r.alive for r in self.replicas):
            raise DistributedError(self._all_lost())
        return outputs

    def take_failures(self) -> list[tuple[str, FwError]]:
        """Requests failed since the last call, with their error (their replica died or refused them)."""
        failures, self._failures = self._failures, []
        return failures

    def _poll(self, timeout: float) -> list:
        remote = [r for r in self.replicas[1:] if r.alive]
        if not remote:
            return []
        ready = multiprocessing.connection.wait([r.conn for r in remote] + [r.proc.sentinel for r in remote], timeout)
        outputs = []
        for replica in remote:
            try:
                while replica.conn.poll(0):
                    message = replica.conn.recv()
                    if message[0] == "outputs":
                        outputs += message[1]
                        replica.stats = message[2]
                    elif message[0] == "rejected":
                        _, request_id, _name, status, kind, text = message
                        error = ReplicaError(text)
                        error.status_code, error.error_type = status, kind
                        self._fail(request_id, error)
                    elif message[0] == "failed":
                        self._lose(replica, f"data-parallel replica {replica.index} failed: {message[1]}")
                        break
            except (EOFError, OSError):
                pass
            if replica.alive and (not replica.proc.is_alive() or replica.proc.sentinel in ready
                                  and replica.proc.exitcode is not None):
                replica.proc.join(0.5)
                self._lose(replica, f"data-parallel replica {replica.index} (pid {replica.proc.pid}) "
                                    f"{describe_exit(replica.proc.exitcode)}")
        return outputs

    def _fail(self, request_id: str, error: FwError) -> None:
        if self._in_flight.pop(request_id, None) is not None:
            self._failures.append((request_id, error))

    def _lose(self, replica: Replica, why: str) -> None:
        """Mark `replica` dead and fail its requests; the others go on."""
        replica.failure = why
        lost = [rid for rid, item in self._in_flight.items() if item.replica == replica.index]
        alive = sum(r.alive for r in self.replicas)
        logger.error("%s; failing its %d request(s); %d of %d replicas left", why, len(lost), alive,
                     len(self.replicas))
        for request_id in lost:
            self._fail(request_id, ReplicaError(f"{why}; retry the request (the other replicas still serve)"
                                                if alive else why))
        if replica.proc is not None:
            stop_processes({replica.index: replica.proc}, 0.0)

    def _all_lost(self) -> str:
        return "every data-parallel replica is lost: " + "; ".join(r.failure or "" for r in self.replicas)

    # -- what the server reports -----------------------------------------------------------

    def stats(self) -> dict:
        """Replica 0's counters summed with the others' last reported ones, and each replica's state."""
        merged = dict(self.local.stats())
        for replica in self.replicas[1:]:
            for key, value in replica.stats.items():
                if key in merged and isinstance(value, (int, float)) and key != "kv_cache_usage":
                    merged[key] += value
        merged["data_parallel"] = [{"replica": r.index, "alive": r.alive, "requests_served": r.served}
                                   for r in self.replicas]
        return merged

    @property
    def degraded(self) -> str | None:
        lost = [r for r in self.replicas if not r.alive or r.proc is not None and not r.proc.is_alive()]
        if not lost:
            return None
        return f"{len(self.replicas) - len(lost)} of {len(self.replicas)} data-parallel replicas serve"

    @property
    def cluster(self):
        """Replica 0's tensor-parallel group is this engine's own concern (step() routes around its loss)."""
        return None

    def close(self) -> None:
        """Stop every replica process (a stop message, then signals); safe to call twice."""
        if self.closed:
            return
        self.closed = True
        for replica in self.replicas[1:]:
            if replica.alive:
                try:
                    replica.conn.send(("stop",))
                except OSError:
                    pass
        stop_processes({r.index: r.proc for r in self.replicas[1:]}, STOP_WAIT_S)
        cluster = getattr(self.local, "cluster", None)
        if cluster is not None:
            cluster.close()
        atexit.unregister(self.close)


def _wait_ready(replica: Replica, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DistributedError(f"data-parallel replica {replica.index} was not ready within {timeout_s:g} s "
                                   f"(--dist-init-timeout)")
        ready = multiprocessing.connection.wait([replica.conn, replica.proc.sentinel], remaining)
        if replica.conn in ready:
            try:
                message = replica.conn.recv()
            except EOFError:
                message = None
            if message is not None and message[0] == "ready":
                replica.stats = message[1]
                return
            if message is not None and message[0] == "failed":
                raise DistributedError(f"data-parallel replica {replica.index} failed while starting: {message[1]}")
        if replica.proc.sentinel in ready or not replica.proc.is_alive():
            replica.proc.join(1.0)
            raise DistributedError(f"data-parallel replica {replica.index} (pid {replica.proc.pid}) "
                                   f"{describe_exit(replica.proc.exitcode)} while starting")
