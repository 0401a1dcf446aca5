"""Busy neighbour processes for `fw bench latency|throughput --contention N`.

Why: a shared host always has neighbours, and a CPU engine that runs as many threads as cores stalls at every
parallel region when one core is taken (fw.engine.cpu_runtime.ThreadGovernor). The figure that matters is
the speed next to a busy process, measured the same way for fw and its baseline.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator

_SPIN = "while True: pass"


@contextlib.contextmanager
def busy_neighbours(count: int) -> Iterator[list[subprocess.Popen]]:
    """`count` processes that each keep one core busy (pure Python spinning) until the block ends. Each runs
    in a session of its own, as another user's job does: where the kernel groups processes by session
    (sched_autogroup), a child in fw's session would be scheduled inside fw's own group instead."""
    procs = [subprocess.Popen([sys.executable, "-c", _SPIN], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True) for _ in range(count)]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()
