"""The CPU cores and torch threads of one rank, when several ranks share a machine.

Why: torch's parallel regions wait at a barrier for every thread, so ranks whose threads
compete for the same cores stall each other at every matmul, and fw's ThreadGovernor (which
shrinks a step's threads to the cores other processes leave) would read the other ranks as
neighbours and shrink to one thread. With at least two cores per rank each rank gets its own
cores and as many threads; with fewer, ranks run one thread each and share the cores (pinning
one rank to one core left gloo's threads no core of their own and made every all-reduce several
times slower on this project's 2-core machine: docs/performance.md, issue 22)."""

from __future__ import annotations

import os
from typing import Callable

import torch


def bind_rank(local_rank: int, local_ranks: int, num_threads: int | None) -> Callable[[], None]:
    """Pin this process (its calling thread and the threads it starts) to its share of the cores and
    set torch's threads; `num_threads` (--num-threads) wins when given. Returns what undoes both, for
    rank 0, whose process (a library user's) may run a one-process engine afterwards."""
    can_pin = hasattr(os, "sched_getaffinity") and hasattr(os, "sched_setaffinity")
    cpus = sorted(os.sched_getaffinity(0)) if can_pin else list(range(os.cpu_count() or 1))
    before = torch.get_num_threads()
    share = len(cpus) // max(1, local_ranks)
    pinned = share >= 2 and can_pin
    if pinned:
        os.sched_setaffinity(0, cpus[local_rank * share:(local_rank + 1) * share])
    torch.set_num_threads(num_threads or max(1, share))

    def undo() -> None:
        if pinned:
            os.sched_setaffinity(0, cpus)
        torch.set_num_threads(before)

    return undo
