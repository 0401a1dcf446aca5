"""The machine's own speed beside a benchmark: which processor it is, a matrix product's rate in the run's
dtype, and a memory read's bandwidth, measured with torch just before and just after the run.

Why: this project's CPU machines are not the same machine every day, and the same bf16 product has run
at twice the rate on one day than on another (docs/performance.md, "The machine's speed"). fw's batched
runs are compute-bound and a transformers baseline much less so, so their ratio moves with the machine.
A report that carries the machine's speed can be set beside another day's.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from typing import Any

import torch

MATMUL_SIZE = 1024  # a square product, cache-friendly and a few milliseconds long on a CPU
READ_BYTES = 256 * 2**20  # larger than any CPU's cache and an H100's L2


def device_name(device: torch.device, cpuinfo: str = "/proc/cpuinfo") -> str:
    """The GPU's name, or the CPU's model with its family and model numbers (Linux), which tell CPU
    generations apart where the model name is only "AMD EPYC"."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    fields: dict[str, str] = {}
    try:  # platform.processor() often says only "x86_64"
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "cpu family", "model") and key not in fields:
                    fields[key] = value.strip()
                if not line.strip() and fields:
                    break  # the first processor's block is enough
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_rate(work: float, call: Callable[[], Any], device: torch.device, calls: int, seconds: float) -> float:
    """work / seconds per call, the best round of `calls` calls over at least three rounds and `seconds`:
    the machine at its fastest that moment, after a core that was idle has come up to speed."""
    call()
    _sync(device)
    best, rounds, deadline = 0.0, 0, time.perf_counter() + seconds
    while rounds < 3 or time.perf_counter() < deadline:
        start = time.perf_counter()
        for _ in range(calls):
            call()
        _sync(device)
        best = max(best, work * calls / (time.perf_counter() - start))
        rounds += 1
    return best


def measure(device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """matmul_gflops: a MATMUL_SIZE-square product in `dtype` (torch's own kernel: oneDNN on CPUs);
    read_gbs: summing READ_BYTES of float32. About half a second in all."""
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=device).to(dtype)
    b = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=device).to(dtype)
    gflops = _best_rate(2 * MATMUL_SIZE**3 / 1e9, lambda: torch.mm(a, b), device, calls=4, seconds=0.2)
    del a, b
    buf = torch.ones(READ_BYTES // 4, device=device)
    gbs = _best_rate(READ_BYTES / 1e9, buf.sum, device, calls=2, seconds=0.1)
    return {"matmul_gflops": round(gflops, 1), "read_gbs": round(gbs, 1)}


def summary_line(machine: dict[str, Any], dtype: str) -> str:
    """One line for a report's header: the processor, then the speeds before (and after) the run."""
    before, after = machine["before"], machine.get("after")
    line = (f"Machine: {machine['device_name']}; {dtype} matmul {before['matmul_gflops']:.0f} GFLOP/s, "
            f"memory read {before['read_gbs']:.0f} GB/s before the run")
    if after:
        line += f" ({after['matmul_gflops']:.0f} and {after['read_gbs']:.0f} after)"
    return line
