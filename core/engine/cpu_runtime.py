"""Process-level settings that decide CPU inference speed more than any kernel does.

Three effects, all measured on SmolLM2 bf16, 64 prompts (docs/performance.md):

* glibc returns freed blocks above 128 KiB to the kernel (mmap/munmap), so every
  activation of that size page-faults anew on the next step; on a VM page faults
  are slow. Keeping such blocks in the heap (`tune_malloc`) raised offline
  throughput by 17% in an A/B of the same script.
* libgomp spins its idle workers only while the process has no more OpenMP
  threads than CPUs. `fw serve` loads the model on the main thread (which leaves
  an OpenMP team behind) and steps it on an engine thread (a second team), so
  every parallel op waited on sleeping workers: a one-thread speed or worse.
  `release_openmp_threads` ends the main thread's team before the engine thread
  starts (docs/performance.md has the figure).
* Weights stream from memory every step: `advise_huge_pages` asks for 2 MiB
  pages for them (fw.kernels.weight_arena; the kernel's transparent huge pages,
  in their "madvise" mode the default on most distributions), so the hardware
  prefetcher and the TLB do not stop every 4 KiB. The KV cache was advised too
  (its attention kernel read 4-6% faster) until it became lazily touched: there
  a first request would make 2 MiB per (layer, K/V, head) resident, 360 MB on
  SmolLM2, so it stays on 4 KiB pages.
* Loading leaves hundreds of MB of freed temporaries in that heap:
  `release_load_memory` trims it once the engine is up.
* The KV cache is sized for the largest batch, but pages are only written as
  sequences use them: `fw.kv_cache.allocation` maps it as the kernel's zero pages,
  so the resident set grows with the tokens held, not with `--kv-cache-memory`.
* Torch's parallel regions wait at a barrier for every thread: with one core
  busy elsewhere, a 2-thread step waits on a descheduled thread hundreds of
  times. `ThreadGovernor` steps with the cores other processes leave free.

`FW_CPU_RUNTIME_TUNING=0` leaves the process as it was.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import gc
import glob
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator

import torch

from fw import env

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 32 << 20  # glibc's maximum: blocks up to 32 MiB come from the heap
_OMP_PAUSE_HARD = 2
_MADV_HUGEPAGE = 14  # from linux/mman.h
_HUGE_PAGE = 2 << 20


def _enabled() -> bool:
    return sys.platform.startswith("linux") and env.CPU_RUNTIME_TUNING.get()


@functools.cache
def tune_malloc() -> bool:
    """Keep freed blocks up to 32 MiB in glibc's heap instead of unmapping them; True if applied."""
    if not _enabled():
        return False
    try:
        libc = _libc()
        ok = libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) == 1
        ok = libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1 and ok
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    return ok


@functools.cache
def _libc() -> ctypes.CDLL:  # once: find_library runs ldconfig in a subprocess, and every arena chunk asks
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask Linux to back the 2 MiB-aligned part of a CPU tensor's memory with huge pages; True if asked.
    Call it before the memory is first written (a fresh `torch.empty`): pages already faulted in stay
    small until khugepaged merges them."""
    if not _enabled() or tensor.device.type != "cpu":
        return False
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first = -(-start // _HUGE_PAGE) * _HUGE_PAGE
    last = end // _HUGE_PAGE * _HUGE_PAGE
    if last <= first:  # smaller than one aligned huge page
        return False
    try:
        madvise = _libc().madvise
    except (OSError, AttributeError):
        return False
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise(first, last - first, _MADV_HUGEPAGE) == 0


_froze_for_load = False  # set by `spare_old_objects`, cleared by `release_load_memory`


def spare_old_objects() -> None:
    """Before loading: hide the objects alive now (the imports' modules, classes and functions, most of a
    process's objects) from the collector until `release_load_memory`, whose collection then looks only at
    what the load made; its garbage is the load's. Leaves a process that froze objects itself alone."""
    global _froze_for_load
    if not _froze_for_load and gc.get_freeze_count() == 0:
        gc.freeze()
        _froze_for_load = True


def release_load_memory(trim: bool = True) -> bool:
    """After loading: collect the loader's garbage (which may hold the checkpoint's file mapping) and give
    the heap's free memory back to the kernel. Why: `tune_malloc` keeps freed blocks for reuse, so the
    temporaries of reading, dequantizing and repacking weights (hundreds of MB) would otherwise stay
    resident for the server's life. True if the heap was trimmed. `trim=False` (a model on a GPU) only
    ends `spare_old_objects`."""
    global _froze_for_load
    if trim or _froze_for_load:
        gc.collect()
    if _froze_for_load:  # the older objects go back under the collector, as the oldest generation
        gc.unfreeze()
        _froze_for_load = False
    if not trim or not _enabled():
        return False
    try:
        return _libc().malloc_trim(0) == 1
    except (OSError, AttributeError):  # not glibc
        return False


def _cpu_ticks(cpus: frozenset[int]) -> tuple[int, int]:
    """(busy clock ticks of `cpus` since boot, all processes; this process's own ticks) from /proc. Steal
    time counts as busy: on a VM it is a neighbour holding the core."""
    busy = 0
    with open("/proc/stat") as stat:
        for line in stat:
            name, *fields = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
                busy += user + nice + system + irq + softirq + steal
    with open("/proc/self/stat") as own:
        fields = own.read().rsplit(")", 1)[1].split()
    return busy, int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))


_LOAD_SAMPLE_MAX_AGE_S = 30.0  # an older first sample says little about the machine now


def _sample_now() -> tuple[float, int, int] | None:
    try:
        return (time.monotonic(), *_cpu_ticks(frozenset(os.sched_getaffinity(0))))
    except (OSError, ValueError, IndexError, AttributeError):
        return None


_FIRST_SAMPLE = _sample_now()  # at import: the CPU time all processes had used when the start-up began


@contextlib.contextmanager
def loading_threads() -> Iterator[int]:
    """Load weights with the cores other processes left free since this module was imported (the imports
    before a load take about a second): one thread when a neighbour kept a core busy on a 2-core machine.
    Why: a load is hundreds of short parallel copies, each ending at a barrier that waits for every thread,
    and a thread that lost its core to a neighbour stalls each of them (docs/performance.md). The thread
    count is restored afterwards; the steps have their own `ThreadGovernor`."""
    threads = torch.get_num_threads()
    want = threads
    now = _sample_now() if _enabled() and threads > 1 else None
    if now is not None and _FIRST_SAMPLE is not None and 0.2 <= now[0] - _FIRST_SAMPLE[0] <= _LOAD_SAMPLE_MAX_AGE_S:
        governor = ThreadGovernor(threads, interval_s=_LOAD_SAMPLE_MAX_AGE_S)
        governor._last = _FIRST_SAMPLE
        others = governor.others_cores(*now)
        if others is not None:
            want = max(1, min(threads, round(len(governor._cpus) - others)))
    if want != threads:
        logger.info("other processes used %.1f of %d cores: loading with %d thread(s) instead of %d",
                    others, len(governor._cpus), want, threads)
        torch.set_num_threads(want)
    try:
        yield want
    finally:
        if want != threads:
            torch.set_num_threads(threads)


class ThreadGovernor:
    """Fits the step's OpenMP thread count to the cores other processes leave free.

    Why: torch's parallel regions end at a barrier that waits for every thread; with as many threads as
    cores and one core busy elsewhere, each of a step's hundreds of regions waits for a descheduled thread,
    and batch-1 decode all but stopped on this project's 2-core machine next to one busy process
    (docs/performance.md).
    Every `interval_s` while the engine steps, the governor measures the CPU time other processes took on the
    cores this process may use. It steps with fewer threads only when two samples in a row (a neighbour busy
    for a second, not a burst) leave fewer cores, and with more again as soon as one sample shows them free.
    A sample that spans an idle engine (no step for several intervals) is dropped: what ran meanwhile did not
    compete with a step.

    The process's own long work beside the steps (the server tokenizing a 1.9 MB prompt) is not a neighbour
    the samples can see: it is this process's time. Such work holds `reserve_core()`, and while it runs the
    steps leave it a core at once (without, a stream's largest gap during a 1.9 MB chat prompt was 0.71 s at
    2 threads, 0.06 s at 1)."""

    def __init__(self, threads: int, interval_s: float = 0.5):
        self.max_threads = self.threads = self.applied = threads
        self.interval_s = interval_s
        self._cpus = frozenset(os.sched_getaffinity(0))
        self._tick_hz = os.sysconf("SC_CLK_TCK")
        self._last: tuple[float, int, int] | None = None
        self._fewer_in_a_row = 0
        self._free_cores = len(self._cpus)  # what others left at the last change of `threads`
        self._reserved = 0  # cores held by `reserve_core` blocks, changed under `_lock`
        self._lock = threading.Lock()

    @classmethod
    def for_this_process(cls) -> "ThreadGovernor | None":
        """A governor where it can help: Linux, tuning on, more than one thread."""
        threads = torch.get_num_threads()
        if not _enabled() or threads < 2 or not os.path.exists("/proc/stat"):
            return None
        return cls(threads)

    def others_cores(self, now: float, busy: int, own: int) -> float | None:
        """Cores other processes used since the last sample (None on the first, or after an idle engine)."""
        last, self._last = self._last, (now, busy, own)
        if last is None or now <= last[0] or now - last[0] > 4 * self.interval_s:
            return None
        return max(0.0, ((busy - last[1]) - (own - last[2])) / (self._tick_hz * (now - last[0])))

    def update(self) -> int:
        """Call before each step (cheap between samples): the thread count it runs with, applied."""
        now = time.monotonic()
        if self._last is None or now - self._last[0] >= self.interval_s:
            self._sample(now)
        want = max(1, min(self.threads, self._free_cores - self._reserved))
        if want != self.applied:
            torch.set_num_threads(want)
            self.applied = want
        return want

    def _sample(self, now: float) -> None:
        try:
            others = self.others_cores(now, *_cpu_ticks(self._cpus))
        except (OSError, ValueError, IndexError):
            return
        if others is None:
            return
        free = round(len(self._cpus) - others)
        want = max(1, min(self.max_threads, free))
        self._fewer_in_a_row = self._fewer_in_a_row + 1 if want < self.threads else 0
        if want > self.threads or self._fewer_in_a_row >= 2:
            logger.info("other processes use %.1f of %d cores: stepping with %d thread(s) instead of %d",
                        others, len(self._cpus), want, self.threads)
            self.threads, self._fewer_in_a_row = want, 0
        if want == self.threads:
            self._free_cores = max(1, free)

    @contextlib.contextmanager
    def reserve_core(self) -> Iterator[None]:
        """While the block runs (on any thread), steps run with one thread fewer than the free cores allow
        (never below one): the block's work takes a core of its own instead of descheduling a step's thread
        at every barrier."""
        with self._lock:
            self._reserved += 1
        try:
            yield
        finally:
            with self._lock:
                self._reserved -= 1


def _libgomp() -> ctypes.CDLL | None:
    """The libgomp torch loaded (its own copy under torch/lib in pip wheels, else the system one)."""
    candidates = glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*")) + ["libgomp.so.1"]
    for path in candidates:
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)  # only if already loaded
        except OSError:
            continue
        if hasattr(lib, "omp_pause_resource_all"):
            return lib
    return None


def release_openmp_threads() -> bool:
    """End the calling thread's OpenMP team, before another thread takes over torch's work; True if done.
    The caller must not run parallel torch ops afterwards (that would start a team again)."""
    if not _enabled() or not torch.backends.openmp.is_available():
        return False
    lib = _libgomp()
    if lib is None:
        return False
    return lib.omp_pause_resource_all(_OMP_PAUSE_HARD) == 0
