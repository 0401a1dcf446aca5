"""The CPU cores and torch threads of one rank, when several ranks share a machine.

Why: torch's parallel regions wait at a barrier for every thread, so ranks whose threads
compete for the same cores stall each other at every matmul, and fw's ThreadGovernor (which
shrinks a step's threads to the cores other processes leave) would read the other ranks as
neighbours and shrink to one thread. With at least two cores per rank each rank gets its own
cores and as many threads; with fewer, ranks run one thread each and share the cores (pinning
one rank to one core left gloo's threads no core of their own: an all-reduce took 2.7 ms instead
of 0.33 ms on this project's 2-core machine, issue 22)."""

from __future__ import annotations

import os

import torch


def bind_rank(local_rank: int, local_ranks: int, num_threads: int | None) -> int:
    """Pin this process (its calling thread and the threads it starts) to its share of the cores and
    set torch's threads; returns the thread count. `num_threads` (--num-threads) wins when given."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    share = len(cpus) // max(1, local_ranks)
    if share >= 2 and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus[local_rank * share:(local_rank + 1) * share])
    threads = num_threads or max(1, share)
    torch.set_num_threads(threads)
    return threads
