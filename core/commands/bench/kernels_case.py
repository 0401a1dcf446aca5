"""One measured kernel call of `fw bench kernels`, and how it is timed.

GPU: CUDA events around each call, with a 256 MiB buffer overwritten between calls so a working
set that fits in L2 (a batch-1 1k-token KV cache is 4 MiB) is read from memory, as it would be
in a real step where the other layers evict it. CPU: time.perf_counter around each call. Either
way, warm-up calls first (Triton compiles, caches fill), then the median of the timed calls.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

_FLUSH_BYTES = 256 * 2**20


@dataclass
class KernelCase:
    """`run()` performs the call; `skipped` says why a case is not run (then `run` is None)."""

    backend: str
    labels: dict[str, int]  # the shape, e.g. {"batch": 32, "context": 8192}
    bytes: int  # bytes the call must move at least (the traffic model of its kind)
    flops: int
    run: Callable[[], None] | None = None
    skipped: str | None = None
    extra: dict = field(default_factory=dict)  # kind-specific figures for the report


def time_call(fn: Callable[[], None], device: torch.device, warmup: int, iters: int) -> list[float]:
    """Seconds per call, one entry per timed call."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return times
    flush = torch.empty(_FLUSH_BYTES, dtype=torch.uint8, device=device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    torch.cuda.synchronize(device)
    for start, end in events:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) / 1e3 for start, end in events]


def median(values: list[float]) -> float:
    return statistics.median(values)
