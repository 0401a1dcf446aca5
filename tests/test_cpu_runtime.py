"""fw.engine.cpu_runtime: the malloc and OpenMP settings the CPU path depends on, and that the server's
engine thread keeps the thread count the user chose (torch's count is per thread)."""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch

from fw.config import EngineConfig
from fw.engine import cpu_runtime
from fw.engine.engine import LLMEngine
from fw.server.async_engine import AsyncEngine

linux_openmp = pytest.mark.skipif(not (sys.platform.startswith("linux") and torch.backends.openmp.is_available()),
                                  reason="glibc malloc and libgomp are Linux builds of torch")


@linux_openmp
def test_malloc_tuning_applies_and_can_be_turned_off(monkeypatch):
    assert cpu_runtime.tune_malloc.__wrapped__() is True
    monkeypatch.setenv("FW_CPU_RUNTIME_TUNING", "0")
    assert cpu_runtime.tune_malloc.__wrapped__() is False
    assert cpu_runtime.release_openmp_threads() is False


def _thp_mode() -> str | None:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return None
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else None


def _smaps_entry(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds `address`."""
    entry: dict[str, str] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        lines = f.readlines()
    for line in lines:
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(part, 16) for part in head.split("-"))
            inside = lo <= address < hi
        elif inside and ":" in head:
            entry[head.rstrip(":")] = line.split(":", 1)[1].strip()
    return entry


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="transparent huge pages are off or absent")
def test_huge_pages_are_advised_for_the_aligned_part(monkeypatch):
    cache = torch.empty(8 << 20, dtype=torch.uint8)  # glibc mmaps it: untouched, its own mapping
    assert cpu_runtime.advise_huge_pages(cache) is True
    middle = (cache.data_ptr() + (4 << 20)) // 4096 * 4096
    assert _smaps_entry(middle).get("THPeligible") == "1"
    assert cpu_runtime.advise_huge_pages(torch.empty(1 << 20, dtype=torch.uint8)) is False  # no aligned 2 MiB
    monkeypatch.setenv("FW_CPU_RUNTIME_TUNING", "0")
    assert cpu_runtime.advise_huge_pages(cache) is False


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


def test_kv_cache_is_zero_and_resident_only_where_written(gqa_dir):
    before = _rss_mib()
    engine = LLMEngine(EngineConfig(model=str(gqa_dir), kv_cache_memory="256MiB"))
    caches = [layer.kv_cache for layer in engine.runner.layers]
    assert sum(c.numel() * c.element_size() for c in caches) > 200 << 20
    assert _rss_mib() - before < 100  # the model and runtime, not the 256 MiB cache
    assert all(bool((c == 0).all()) for c in caches)  # read: zero pages, still not resident
    assert _rss_mib() - before < 100
    caches[0].view(-1)[: 32 << 20].fill_(1)  # written pages become resident
    assert _rss_mib() - before > 32


def test_load_memory_is_given_back(monkeypatch):
    """Freed load-time temporaries leave the heap (tune_malloc keeps freed blocks otherwise)."""
    cpu_runtime.tune_malloc()
    blocks = [torch.ones(4 << 20, dtype=torch.uint8) for _ in range(64)]  # 256 MiB of heap blocks (< 32 MiB each)
    del blocks
    high = _rss_mib()
    assert cpu_runtime.release_load_memory() is True
    assert _rss_mib() < high - 128
    monkeypatch.setenv("FW_CPU_RUNTIME_TUNING", "0")
    assert cpu_runtime.release_load_memory() is False


@linux_openmp
def test_openmp_team_release_leaves_torch_working():
    a = torch.randn(256, 2048)
    expected = (a * 2 + 1).sum()
    assert cpu_runtime.release_openmp_threads() is True
    assert torch.equal((a * 2 + 1).sum(), expected)  # the next parallel op starts a team again

    results = []
    worker = threading.Thread(target=lambda: results.append((a * 2 + 1).sum()))
    worker.start()
    worker.join()
    assert torch.equal(results[0], expected)


def test_engine_thread_keeps_the_callers_thread_count(gqa_dir):
    engine = LLMEngine(EngineConfig(model=str(gqa_dir), num_kv_blocks=16, dtype="float32"))
    before = torch.get_num_threads()
    seen = []
    try:
        torch.set_num_threads(1)
        async_engine = AsyncEngine(engine)
        async_engine._commands.put((lambda: seen.append(torch.get_num_threads()), _future()))
        async_engine.start()
        async_engine._wake.set()
        for _ in range(200):
            if seen:
                break
            threading.Event().wait(0.01)
        async_engine._stop.set()
        async_engine._wake.set()
        async_engine._thread.join(timeout=10)
    finally:
        torch.set_num_threads(before)
    assert seen == [1]


def _future():
    import concurrent.futures

    return concurrent.futures.Future()


def test_weight_arena_packs_weights_side_by_side_on_huge_pages():
    from fw.kernels import weight_arena

    arena = weight_arena.HugePageArena()
    a, b = arena.take(100), arena.take(3 << 20)
    assert a.data_ptr() % weight_arena.HUGE_PAGE == 0  # a fresh chunk starts on a huge page
    assert b.data_ptr() == a.data_ptr() + 128  # the next weight, on the next cache line of the same chunk
    assert _smaps_entry(a.data_ptr()).get("THPeligible") == "1"
    big = arena.take(weight_arena.CHUNK + 5)  # larger than a chunk: a chunk of its own
    assert big.numel() == weight_arena.CHUNK + 5 and big.data_ptr() % weight_arena.HUGE_PAGE == 0
    w = torch.randn(7, 5, dtype=torch.bfloat16)
    held = weight_arena.holding(w)
    assert torch.equal(held, w) and held.dtype == w.dtype and held.shape == w.shape


def test_thread_governor_follows_the_cores_others_leave(monkeypatch):
    """Busy neighbours measured from /proc ticks: one busy core of two for two samples -> 1 thread, free again
    -> 2 at once; a one-sample burst and a sample spanning an idle engine change nothing; never below 1."""
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    clock = [100.0]
    monkeypatch.setattr(cpu_runtime.time, "monotonic", lambda: clock[0])
    gov = cpu_runtime.ThreadGovernor(2, interval_s=0.5)
    gov._cpus, gov._tick_hz = frozenset({0, 1}), 100
    ticks = {"busy": 0, "own": 0}
    monkeypatch.setattr(cpu_runtime, "_cpu_ticks", lambda cpus: (ticks["busy"], ticks["own"]))

    def advance(seconds: float, others_cores: float, own_cores: float) -> int:
        clock[0] += seconds
        ticks["busy"] += int(100 * seconds * (others_cores + own_cores))
        ticks["own"] += int(100 * seconds * own_cores)
        return gov.update()

    assert gov.update() == 2 and calls == []  # first sample: nothing to compare with
    assert advance(1.0, 0.1, 1.9) == 2  # alone
    assert advance(0.1, 1.0, 1.0) == 2  # within the interval: not sampled
    assert advance(1.0, 1.0, 1.0) == 2 and calls == []  # a neighbour for one sample: a burst
    assert advance(1.0, 0.0, 1.9) == 2  # gone again
    assert advance(1.0, 1.0, 1.0) == 2 and advance(1.0, 1.0, 1.0) == 1 and calls == [1]  # sustained
    assert advance(1.0, 0.0, 1.0) == 2 and calls == [1, 2]  # free: back at once
    assert advance(10.0, 2.0, 0.0) == 2  # the engine was idle while others ran: dropped
    assert advance(1.0, 5.0, 1.0) == 2 and advance(1.0, 5.0, 1.0) == 1  # never below one thread
    assert cpu_runtime.ThreadGovernor(4).max_threads == 4


def test_reserve_core_leaves_the_process_own_work_a_core_at_once(monkeypatch):
    """While a block holds reserve_core (the server's tokenizer thread at work), the very next step runs
    with one thread fewer than the free cores allow, never below one, and with all of them again after:
    the tokenizer is this process's time, invisible to the samples."""
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.setattr(cpu_runtime, "_cpu_ticks", lambda cpus: (0, 0))  # no neighbours
    gov = cpu_runtime.ThreadGovernor(2, interval_s=0.5)
    gov._cpus = frozenset({0, 1})
    assert gov.update() == 2 and calls == []
    with gov.reserve_core():
        assert gov.update() == 1 and calls == [1]
        with gov.reserve_core():  # two blocks: still one thread
            assert gov.update() == 1 and calls == [1]
        assert gov.update() == 1
    assert gov.update() == 2 and calls == [1, 2]
    wide = cpu_runtime.ThreadGovernor(4)  # 4 threads on 8 cores: the reserved core comes from the spare ones
    wide._cpus, wide._free_cores = frozenset(range(8)), 8
    with wide.reserve_core():
        assert wide.update() == 4


def test_tokenizer_thread_work_holds_a_reserved_core(gqa_dir, monkeypatch):
    """AsyncEngine.in_tokenizer_thread runs its work inside the CPU governor's reserve_core."""
    import asyncio

    engine = LLMEngine(EngineConfig(model=str(gqa_dir), num_kv_blocks=16, dtype="float32", num_threads=2))
    governor = engine.runner.governor
    if governor is None:
        pytest.skip("no ThreadGovernor here (not Linux, or the CPU runtime tuning is off)")
    async_engine = AsyncEngine(engine)
    assert asyncio.run(async_engine.in_tokenizer_thread(lambda: governor._reserved)) == 1
    assert governor._reserved == 0


def test_thread_governor_is_off_for_one_thread_or_without_tuning(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert cpu_runtime.ThreadGovernor.for_this_process() is None
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    if sys.platform.startswith("linux"):
        assert cpu_runtime.ThreadGovernor.for_this_process() is not None
    monkeypatch.setenv("FW_CPU_RUNTIME_TUNING", "0")
    assert cpu_runtime.ThreadGovernor.for_this_process() is None


def test_bench_contention_starts_and_stops_busy_neighbours():
    from fw.commands.bench.contention import busy_neighbours

    import os

    with busy_neighbours(2) as procs:
        assert len(procs) == 2 and all(p.poll() is None for p in procs)
        # another session each, as the neighbour (another user's job, another scheduler autogroup)
        assert all(os.getsid(p.pid) == p.pid != os.getsid(0) for p in procs)
    assert all(p.poll() is not None for p in procs)


class _Node:
    pass


def _cycle():
    """A weak reference to one of two objects that only refer to each other (garbage for the collector)."""
    import weakref

    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_load_collection_looks_at_the_load_objects_only():
    """spare_old_objects hides what was alive before the load from release_load_memory's collection (the
    imports' objects are not the load's garbage); the load's own garbage cycles are collected, and the old
    objects are back under the collector afterwards."""
    import gc

    gc.unfreeze()  # an earlier in-process `fw` command froze its start-up's objects (fw.warm.startup)
    old = _cycle()
    cpu_runtime.spare_old_objects()
    assert gc.get_freeze_count() > 0
    new = _cycle()  # garbage made by "the load"
    cpu_runtime.release_load_memory(trim=False)
    assert new() is None and old() is not None
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert old() is None


def test_load_collection_leaves_objects_frozen_by_the_process_alone():
    import gc

    old = _cycle()
    gc.freeze()
    try:
        cpu_runtime.spare_old_objects()
        cpu_runtime.release_load_memory(trim=False)
        gc.collect()
        assert old() is not None  # still frozen: fw did not unfreeze what it had not frozen
    finally:
        gc.unfreeze()
    gc.collect()
    assert old() is None


def test_the_collector_pauses_for_a_start_up_and_freezes_what_it_made():
    """fw serve / fw generate pause the automatic collector while they start (fw.warm.startup); resuming
    freezes the start-up's objects and turns it back on, and leaves a collector the caller had turned off."""
    import gc

    from fw.warm import startup

    startup.pause_collector()
    assert not gc.isenabled()
    kept = _cycle()
    startup.resume_collector()
    try:
        assert gc.isenabled() and gc.get_freeze_count() > 0
        gc.collect()
        assert kept() is not None  # frozen: start-up's objects are not scanned again
        gc.disable()
        startup.pause_collector()
        startup.resume_collector()
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.unfreeze()


def test_fw_pauses_the_collector_for_engine_start_ups_and_resumes_it_when_one_fails(tmp_path, monkeypatch):
    import gc

    from fw.cli import main as cli

    paused = []
    pause = cli.pause_collector
    monkeypatch.setattr(cli, "pause_collector", lambda: paused.append(gc.isenabled()) or pause())
    assert cli.main(["--log-level", "ERROR", "generate", "--model", str(tmp_path / "missing"), "--prompt", "hi"]) == 2
    assert paused == [True] and gc.isenabled()
    gc.unfreeze()
    with pytest.raises(SystemExit):
        cli.main(["plugins", "--help"])
    assert paused == [True]  # only the commands that start an engine pause it


@pytest.mark.parametrize("others_busy, stale, expected", [(1.0, False, 1), (0.1, False, 2), (1.0, True, 2)])
def test_weights_load_with_the_cores_other_processes_left(monkeypatch, others_busy, stale, expected):
    """loading_threads: what other processes used since fw.engine.cpu_runtime was imported decides the load's
    thread count (one on 2 cores next to a busy neighbour), which is restored afterwards; a first sample
    older than a load's imports says nothing and changes nothing."""
    monkeypatch.setattr(cpu_runtime.os, "sched_getaffinity", lambda pid: {0, 1})
    hz = os.sysconf("SC_CLK_TCK")
    start = (100.0, 0, 0)
    seconds = 60.0 if stale else 1.0
    now = (start[0] + seconds, int(hz * seconds * (others_busy + 1)), int(hz * seconds))  # this process: 1 core
    monkeypatch.setattr(cpu_runtime, "_FIRST_SAMPLE", start)
    monkeypatch.setattr(cpu_runtime, "_sample_now", lambda: now)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with cpu_runtime.loading_threads() as threads:
            assert threads == expected == torch.get_num_threads()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
