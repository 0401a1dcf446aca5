"""Worker processes of this node: started with torch.multiprocessing's spawn method, and stopped
so that none outlives the call that stops them."""

from __future__ import annotations

import os
import signal
import time

import torch.multiprocessing as mp

from fw.config import EngineConfig
from fw.distributed.worker import run_worker

STOP_WAIT_S = 5.0  # what a worker idle in its step loop gets to leave on its own


def describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def spawn_workers(config: EngineConfig, addr: str, ranks: range, local_ranks: int) -> dict[int, mp.Process]:
    """This node's workers, started with the spawn method (a fork would copy the parent's threads
    and CUDA state). Daemons: they are terminated if this process exits without closing them."""
    context = mp.get_context("spawn")
    procs = {}
    for rank in ranks:
        proc = context.Process(target=run_worker, args=(config, rank, addr, rank % local_ranks, local_ranks),
                               name=f"fw-tp-rank{rank}", daemon=True)
        proc.start()
        procs[rank] = proc
    return procs


def _join_all(procs: dict[int, mp.Process], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for proc in procs.values():
        proc.join(max(0.0, deadline - time.monotonic()))


def stop_processes(procs: dict[int, mp.Process], grace_s: float = STOP_WAIT_S) -> None:
    """Give `procs` `grace_s` to end on their own, then SIGTERM, then SIGKILL: none outlives this call."""
    _join_all(procs, grace_s)
    for stop in (mp.Process.terminate, mp.Process.kill):
        alive = [p for p in procs.values() if p.is_alive()]
        if not alive:
            return
        for proc in alive:
            stop(proc)
            try:
                os.kill(proc.pid, signal.SIGCONT)  # a stopped process acts on SIGTERM only once continued
            except OSError:
                pass
        _join_all(procs, 2.0)
