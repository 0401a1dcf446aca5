"""Stopping worker processes so that none outlives the call that stops them, and saying how one
ended. The processes are what an executor started (fw.plugins.executor.WorkerProcess: the `mp`
executor's are torch.multiprocessing's spawned processes)."""

from __future__ import annotations

import os
import signal
import time
from typing import Mapping

from fw.plugins.executor import WorkerProcess

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


def reap_ended(procs: Mapping[int, WorkerProcess], ready: list) -> None:
    """Read the exit status of each process whose sentinel is in `ready` (from
    `multiprocessing.connection.wait`). A sentinel is ready once the process has closed its files, a moment
    before its status can be read (longer on a loaded machine); until then it reads as still running."""
    for proc in procs.values():
        if proc.sentinel in ready:
            proc.join(STOP_WAIT_S)


def _join_all(procs: Mapping[int, WorkerProcess], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for proc in procs.values():
        proc.join(max(0.0, deadline - time.monotonic()))


def stop_processes(procs: Mapping[int, WorkerProcess], grace_s: float = STOP_WAIT_S) -> None:
    """Give `procs` `grace_s` to end on their own, then SIGTERM, then SIGKILL: none outlives this call."""
    _join_all(procs, grace_s)
    for stop in ("terminate", "kill"):
        alive = [p for p in procs.values() if p.is_alive()]
        if not alive:
            return
        for proc in alive:
            getattr(proc, stop)()
            try:
                if proc.pid is not None:
                    os.kill(proc.pid, signal.SIGCONT)  # a stopped process acts on SIGTERM only once continued
            except OSError:
                pass
        _join_all(procs, 2.0)
