"""The startup report: how long each phase of bringing an engine up took.

Why: a server that scales on demand is judged by its time to ready, and the
time hides in different places (imports, resolving the model, reading
weights, building kernels, allocating the KV cache, compiling, warming up).
Each phase is recorded as it finishes into one process-wide report, logged as
`startup: load weights 1.23 s`, exposed on `/metrics` as
`fw_startup_phase_seconds{phase="..."}` and readable from the library as
`llm.engine.startup_report`.

Code that brings something up wraps it in `phase(name)`; sequential code that
would need a deep re-indent uses `laps()`. An engine starts a new report with
`begin()`, so a second engine in one process gets its own figures.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from fw.started import IMPORTED_AT

logger = logging.getLogger("fw.startup")

# The phases fw itself records, in start-up order (plugins and the compile step may add others).
IMPORT = "import"  # process start to the first engine: Python, torch, transformers, fw, flags
RESOLVE = "resolve"  # model files, config, tokenizer, architecture/backend/quantization choice
CPP_OPS = "C++ ops"  # fused CPU ops: loaded from the cache, or built
LOAD_WEIGHTS = "load weights"  # build the model and read its weights
ALLOCATE_KV_CACHE = "allocate KV cache"
COMPILE = "compile/capture"  # torch.compile / CUDA graphs (recorded by fw.compile)
WARMUP = "warm-up"


def process_age() -> float | None:
    """Seconds since this program started (None where /proc is not available).

    /proc dates a process from its fork. A shell that runs other commands and then execs fw as its last one
    (`./scripts/bootstrap.sh && fw serve`; a container's `setup && exec fw serve`) forked long before fw
    began, so the age is also bounded by the time since `import fw` plus the CPU time the process had used
    by then: the interpreter's start, for `fw` itself (a waiting shell uses almost none). A program that
    waits before it imports fw is dated from about that import."""
    imported, cpu_then = IMPORTED_AT
    since_exec = time.monotonic() - imported + cpu_then
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 of stat(5); the split drops pid and comm
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, min(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), since_exec))


class StartupReport:
    """Phase name -> seconds, in the order the phases finished; `ready_seconds`: process start to
    ready (set by the server once it accepts requests)."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self.ready_seconds: float | None = None
        self._lock = threading.Lock()

    def add(self, name: str, seconds: float) -> None:
        """Record a phase (a phase run twice adds up)."""
        with self._lock:
            self.phases[name] = self.phases.get(name, 0.0) + seconds

    def as_dict(self) -> dict[str, float]:
        with self._lock:
            return dict(self.phases)

    def lines(self) -> list[str]:
        out = [f"startup: {name} {seconds:.2f} s" for name, seconds in self.as_dict().items()]
        if self.ready_seconds is not None:
            out.append(f"startup: ready {self.ready_seconds:.2f} s after process start")
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def __repr__(self) -> str:
        phases = ", ".join(f"{k}={v:.3f}s" for k, v in self.as_dict().items())
        return f"StartupReport({phases})"


_current = StartupReport()
_began = False
_state_lock = threading.Lock()


def begin() -> StartupReport:
    """Start the report of a new engine and make it the one phases record into. The first engine of
    the process also gets an `import` phase: the time from process start to here."""
    global _current, _began
    with _state_lock:
        first = not _began
        _began = True
        report = _current if first else StartupReport()
        _current = report
    if first and IMPORT not in report.phases:
        age = process_age()
        if age is not None:
            report.add(IMPORT, age)
            logger.info("startup: %s %.2f s", IMPORT, age)
    return report


def current() -> StartupReport:
    """The report phases are recorded into now."""
    return _current


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Time the block as phase `name` of the current report (recorded and logged when it finishes
    without an exception)."""
    report = _current
    start = time.perf_counter()
    yield
    _record(report, name, time.perf_counter() - start)


def laps() -> Callable[[str], None]:
    """A stopwatch for sequential code: each call `lap(name)` records the time since the previous
    call (or since `laps()`) as phase `name`."""
    report = _current
    last = [time.perf_counter()]

    def lap(name: str) -> None:
        now = time.perf_counter()
        _record(report, name, now - last[0])
        last[0] = now

    return lap


def mark_ready() -> float | None:
    """Record (and log) the time from process start to now as the current report's `ready_seconds`."""
    age = process_age()
    if age is not None:
        _current.ready_seconds = age
        logger.info("startup: ready %.2f s after process start", age)
    return age


def _record(report: StartupReport, name: str, seconds: float) -> None:
    report.add(name, seconds)
    logger.info("startup: %s %.2f s", name, seconds)


_collector_paused = False


def pause_collector() -> None:
    """Turn the cyclic garbage collector's automatic passes off for a command's start-up. Why: importing
    torch and fw and building a model make millions of objects that live as long as the process, and each
    full pass over them (several run while they are made) finds no garbage. The loader's garbage is
    collected explicitly (fw.engine.cpu_runtime.release_load_memory); `resume_collector` ends the pause."""
    global _collector_paused
    if gc.isenabled():
        gc.disable()
        _collector_paused = True


def resume_collector() -> None:
    """End `pause_collector` (a no-op without one): what start-up made is frozen (gc.freeze: never scanned
    again, as vLLM does once its engine is up), and the collector runs as before for what comes next."""
    global _collector_paused
    if _collector_paused:
        gc.freeze()
        gc.enable()
        _collector_paused = False
