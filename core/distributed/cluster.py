"""Rank 0's side of tensor parallelism: start the other ranks, feed them every forward step,
notice when one dies, and stop them.

Rank 0 is the engine itself. `Cluster.start` (called by the engine before it loads the model)
checks that the model can be split, opens the meeting point, has the executor
(--distributed-executor-backend, fw.plugins.executor) start this node's workers and waits for
every rank (those of other nodes too) to join; the engine
then loads rank 0's shard with `cluster.tp`. `agree_pages` settles the KV page count with the
workers and `drive` hooks the model so that each forward pass first broadcasts its step (fw.distributed.step). A worker that
dies is noticed by a watcher thread at once and by the next collective in a few milliseconds;
either way the engine raises `DistributedError` naming the rank and how it ended, and every
later step fails the same way rather than hang."""

from __future__ import annotations

import atexit
import logging
import multiprocessing.connection
import threading
import weakref
from datetime import timedelta

import torch

from fw.config import EngineConfig
from fw.distributed import kv_budget, rendezvous, shm, step
from fw.distributed.backend import executor_for, worker_launch
from fw.distributed.checks import check_config, check_layout
from fw.distributed.group import TensorParallel
from fw.distributed.processes import STOP_WAIT_S, describe_exit, reap_ended, stop_processes
from fw.distributed.threads import bind_rank
from fw.errors import ConfigError, DistributedError
from fw.kv_cache.allocation import PageBudget
from fw.plan import resolve
from fw.plan.rules import resolve_device

logger = logging.getLogger("fw.distributed")


class Cluster:
    """The ranks of one tensor-parallel engine, as rank 0 sees them."""

    def __init__(self, config: EngineConfig, store, addr: str, procs: dict):
        self.config = config
        self.world = config.tensor_parallel_size
        self.store, self.addr, self.procs = store, addr, procs
        self.group = None  # gloo: the step broadcast, and the all-reduces on the CPU without `local`
        self.local = None  # the shared-memory all-reduce of a single machine's CPU ranks (fw.distributed.shm)
        self.tp: TensorParallel | None = None
        self.failure: str | None = None  # set once a rank is lost: every later step raises it
        self.stepping = False  # the workers are in their step loop (a STOP can reach them)
        self.closed = False
        # One thread at a time reads the workers' exit status: a waitpid that another thread beat to the
        # reaping reads "still running" (the watch thread against a failed collective's).
        self._reaping = threading.RLock()
        self.unbind = lambda: None  # gives this process back the cores and threads it had (threads.py)
        self._step_timeout = timedelta(seconds=config.dist_timeout)
        atexit.register(self.close)
        if procs:
            ref = weakref.ref(self)
            threading.Thread(target=_watch, args=(ref, procs), name="fw-tp-watch", daemon=True).start()

    @classmethod
    def start(cls, config: EngineConfig, plugins) -> "Cluster | None":
        """None for one rank. Else: refuse what cannot be split, have the executor start this node's
        workers, wait for every rank to join (at most --dist-init-timeout) and connect the group."""
        check_layout(config)
        executor = executor_for(config, plugins)  # a bad --distributed-executor-backend fails at one rank too
        if executor is None or config.tensor_parallel_size == 1:
            return None
        if config.node_rank != 0:
            raise ConfigError(f"--node-rank {config.node_rank} runs tensor-parallel workers only: start it with "
                              f"`fw serve` (or `fw generate`) and the same flags; the engine runs on node 0")
        if config.model is not None:
            _check_model(config, plugins)
        world, local_ranks = config.tensor_parallel_size, config.tensor_parallel_size // config.nnodes
        met = executor.meeting_point(config)  # a launcher's store (torchrun), else one rank 0 serves
        store, addr = met if met is not None else rendezvous.serve_store(config.dist_init_addr, world,
                                                                         config.dist_init_timeout)
        procs = dict(executor.start_workers(worker_launch(config, addr, range(1, local_ranks), local_ranks)))
        cluster = cls(config, store, addr, procs)
        try:
            try:
                rendezvous.wait_for_ranks(store, list(range(1, world)), addr, config.dist_init_timeout, config,
                                          cluster.raise_if_failed)
            except DistributedError as exc:
                rendezvous.release(store, str(exc))
                raise
            cluster.local = shm.create(store, world, config.dist_timeout) if shm.wanted(config) else None
            rendezvous.release(store)
            cluster.unbind = bind_rank(0, local_ranks, config.num_threads)
            cluster.group = rendezvous.gloo_group(store, 0, world, config.dist_timeout,
                                                  rendezvous.split_addr(addr)[0])
            shm.unlink(cluster.local)  # every rank mapped it before joining the group
            reduce = rendezvous.device_group(store, 0, world, config.dist_timeout,
                                             resolve_device(config.device).type, cluster.group)
            cluster.tp = TensorParallel(0, world, reduce, on_failure=cluster.lost, local=cluster.local,
                                        check=cluster.raise_if_failed)
        except BaseException:
            cluster.close()
            raise
        logger.info("tensor parallel: %d ranks joined at %s", world, addr)
        return cluster

    # -- serving -------------------------------------------------------------------------

    def agree_pages(self, own: PageBudget) -> int:
        """The KV page count every rank allocates: the smallest any rank's own budget holds
        (fw.distributed.kv_budget). A rank whose budget holds no page fails start-up, named."""
        self.raise_if_failed()
        try:
            return kv_budget.agree_pages(self.group, 0, self.world, own,
                                         timedelta(seconds=self.config.dist_init_timeout))
        except ConfigError:
            self.close()  # every worker raised the same error and is ending
            raise
        except Exception as exc:
            raise self.lost(exc) from exc

    def drive(self, runner) -> None:
        """Broadcast every forward step of `runner`'s model before it runs (a forward pre-hook: the
        model runner is unchanged)."""
        self.stepping = True
        runner.model.register_forward_pre_hook(self._before_forward)

    def _before_forward(self, module, args) -> None:
        input_ids, positions, meta = args[:3]
        head, payload = step.pack(input_ids, positions, meta)
        self._collective(lambda: self.group.broadcast(head, 0, self._step_timeout))
        self._collective(lambda: self.group.broadcast(payload, 0, self._step_timeout))

    def _collective(self, issue) -> None:
        self.raise_if_failed()
        try:
            issue().wait()
        except Exception as exc:
            raise self.lost(exc) from exc

    # -- failures ------------------------------------------------------------------------

    def raise_if_failed(self) -> None:
        """Raise the failure once there is one (a worker of this node that ended counts): cheap, called
        before each step and every millisecond of a shared-memory all-reduce's wait."""
        if self.failure is None:
            with self._reaping:
                self._note_dead_workers()
                if self.failure is not None:
                    logger.error("%s", self.failure)
                    self._stop_workers()  # the others would wait for the lost rank until --dist-timeout
        if self.failure is not None:
            raise DistributedError(self.failure)

    def _note_dead_workers(self) -> None:
        for rank, proc in sorted(self.procs.items()):
            if not proc.is_alive() and self.failure is None and not self.closed:
                reported = rendezvous.reported_errors(self.store, [rank]).get(rank)
                if reported is None and proc.exitcode == 1 and not self.store.check([f"joined/{rank}"]):
                    # died before reaching fw's code: the spawned interpreter re-imports the main module
                    reported = ("it failed before joining; if you started fw from a script, put the script's "
                                "top level under `if __name__ == \"__main__\":` (workers are spawned processes, "
                                "which import the main module)")
                self.failure = (f"tensor-parallel worker rank {rank} (pid {proc.pid}) {describe_exit(proc.exitcode)}"
                                + (f": {reported}" if reported else "") + "; the engine cannot step without it")

    def lost(self, exc: BaseException) -> DistributedError:
        """The error for a collective that failed: which rank is gone and how, when this node knows;
        the worker's own report when it left one; else the collective's error and what to check."""
        with self._reaping:
            if self.failure is None:  # a peer's socket closed: give its death a moment to show
                alive = [p.sentinel for p in self.procs.values() if p.is_alive()]
                if alive:
                    reap_ended(self.procs, multiprocessing.connection.wait(alive, timeout=0.5))
                self._note_dead_workers()
            if self.failure is None:
                errors = rendezvous.reported_errors(self.store, range(1, self.world))
                if errors:
                    rank, message = min(errors.items())
                    self.failure = f"tensor-parallel rank {rank} failed: {message}"
            if self.failure is None:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                alive = [str(r) for r, p in sorted(self.procs.items()) if p.is_alive()]
                plural = len(alive) > 1
                where = (f"this node's rank{'s' * plural} {', '.join(alive)} still run{'s' * (not plural)} (stopped, "
                         f"swapping or overloaded?)" if alive else "no rank of this node died")
                self.failure = (f"the {self.world} tensor-parallel ranks did not answer within --dist-timeout "
                                f"{self.config.dist_timeout:g} s or lost a peer ({first}); {where}; a rank on another "
                                f"node may have died")
            logger.error("%s", self.failure)
            self._stop_workers()
        return DistributedError(self.failure)

    # -- shutdown ------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the workers (a STOP message when they are idle in their step loop, else signals) and
        drop the group. Safe to call twice; also runs at interpreter exit."""
        if self.closed:
            return
        if self.stepping and self.failure is None:
            try:
                self.group.broadcast(step.header(step.STOP), 0, timedelta(seconds=STOP_WAIT_S)).wait()
            except Exception:
                pass
        self.closed = True
        self._stop_workers()
        shm.unlink(self.local)
        self.group = self.tp = self.local = None
        self.unbind()
        atexit.unregister(self.close)

    def _stop_workers(self) -> None:
        with self._reaping:
            stop_processes(self.procs, STOP_WAIT_S if self.stepping and self.failure is None else 0.0)


def _check_model(config: EngineConfig, plugins) -> None:
    plan = resolve(config, plugins, tokenizer=False, explain=False, until="architecture")
    plan.check("model", "architecture")
    check_config(config, plan.hf_config, plan.architecture, plan.source.kind)


def _watch(ref: "weakref.ref[Cluster]", procs: dict) -> None:
    """Wait for any worker to end; unless the cluster is closing, mark the cluster failed (so the next
    step raises at once), log it and stop the other workers. Holds the cluster only weakly."""
    ready = multiprocessing.connection.wait([p.sentinel for p in procs.values()])
    cluster = ref()
    if cluster is None or cluster.closed or cluster.failure is not None:
        return
    with cluster._reaping:
        reap_ended(procs, ready)
    try:
        cluster.raise_if_failed()  # logs the failure and stops the other workers
    except DistributedError:
        pass
