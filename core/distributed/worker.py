"""The ranks other than 0: each loads its shard, then runs forward steps as rank 0 broadcasts them
until told to stop. No scheduler, no sampler, no tokenizer work: what a worker computes leaves it
only through the all-reduces inside the model, so it cannot disagree with rank 0 about a token."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import time
from datetime import timedelta

import torch

from fw.config import EngineConfig
from fw.distributed import rendezvous, shm, step
from fw.distributed.group import TensorParallel
from fw.distributed.kv_budget import agree_pages
from fw.distributed.threads import bind_rank
from fw.engine.model_runner import ModelRunner
from fw.errors import DistributedError, FwError
from fw.kv_cache.allocation import page_budget
from fw.model.loader import load_model
from fw.plan.rules import resolve_device
from fw.plugins.manager import engine_plugins

logger = logging.getLogger("fw.distributed")

# How long an idle worker waits for rank 0's next step: a server may see no request for days. A rank 0
# that dies closes its sockets, which ends the wait at once.
_IDLE_WAIT = timedelta(days=30)


def _exit_with_parent() -> None:
    """A watcher thread: end this process when the process that started it is gone (killed before the
    group formed, say), so no worker outlives its engine."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="fw-tp-parent", daemon=True).start()


def run_worker(config: EngineConfig, rank: int, addr: str, local_rank: int, local_ranks: int,
               connect=rendezvous.reach_store) -> None:
    """A worker process's main (spawned by rank 0 or a node, or started by a launcher, whose store
    `connect` opens). It ends with os._exit: tearing down gloo's threads in the interpreter's
    finalisation aborted the process now and then (SIGABRT after a clean STOP)."""
    _exit_with_parent()
    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s rank {rank} %(name)s: %(message)s")
    store, code = None, 1
    try:
        store = connect(addr, rank, config.dist_init_timeout)
        rendezvous.announce(store, rank, config)
        rendezvous.wait_for_release(store, rank, config.dist_init_timeout)
        local = shm.attach(store, rank, config.tensor_parallel_size, config.dist_timeout)  # before the group forms
        bind_rank(local_rank, local_ranks, config.num_threads)
        if resolve_device(config.device).type == "cuda":  # rank r of a node on its GPU r
            config = dataclasses.replace(config, device=f"cuda:{local_rank}")
            torch.cuda.set_device(local_rank)
        world = config.tensor_parallel_size
        group = rendezvous.gloo_group(store, rank, world, config.dist_timeout, rendezvous.split_addr(addr)[0])
        reduce = rendezvous.device_group(store, rank, world, config.dist_timeout, config.device, group)
        Worker(config, rank, group, reduce, local).run()
        code = 0
    except FwError as exc:
        rendezvous.report_error(store, rank, str(exc))
        logger.error("%s", exc)
    except Exception as exc:
        rendezvous.report_error(store, rank, f"{type(exc).__name__}: {exc}")
        logger.exception("tensor-parallel rank %d failed", rank)
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class Worker:
    """`group`: gloo, for rank 0's step broadcasts; `reduce`: the model's all-reduces (gloo or NCCL), or
    `local`, the shared-memory all-reduce, when rank 0 offered one."""

    def __init__(self, config: EngineConfig, rank: int, group, reduce, local=None):
        self.config, self.rank, self.group = config, rank, group
        self.tp = TensorParallel(rank, config.tensor_parallel_size, reduce, on_failure=self._lost, local=local)

    def _lost(self, exc: BaseException) -> DistributedError:
        return DistributedError(f"rank {self.rank}: a collective failed, rank 0 or a peer is gone "
                                f"({str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__})")

    def _broadcast(self, tensor: torch.Tensor, timeout: timedelta) -> None:
        try:
            self.group.broadcast(tensor, 0, timeout).wait()
        except Exception as exc:
            raise self._lost(exc) from None

    def run(self) -> None:
        """Load this rank's shard, allocate the KV pages all ranks agreed on, then step until STOP."""
        config = self.config
        plugins = engine_plugins(config)
        loaded = load_model(config, plugins, self.tp)
        own = page_budget(config, loaded, config.kv_cache_page_size)  # this rank's KV heads, memory and flags
        try:
            count = agree_pages(self.group, self.rank, config.tensor_parallel_size, own,
                                timedelta(seconds=config.dist_init_timeout))
        except FwError:
            raise
        except Exception as exc:
            raise self._lost(exc) from None
        runner = ModelRunner(loaded.model, loaded.attention.chosen.backend_cls, count, config.kv_cache_page_size,
                             loaded.dtype, loaded.device)
        self.serve(runner)

    @torch.inference_mode()
    def serve(self, runner) -> None:
        head = torch.zeros(step.HEADER_SIZE, dtype=torch.long)
        timeout = timedelta(seconds=self.config.dist_timeout)
        while True:
            self._broadcast(head, _IDLE_WAIT)
            values = head.tolist()
            if values[0] == step.STOP:
                return
            payload = torch.empty(step.payload_size(values), dtype=torch.long)
            self._broadcast(payload, timeout)
            batch = step.unpack(values, payload, runner.page_size, runner.device)
            batch.meta.backend_state = runner.backend.prepare(batch.meta)
            runner.model(batch.input_ids, batch.positions, batch.meta)
