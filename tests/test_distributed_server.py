"""`fw serve` with several processes (issue 22): a lost tensor-parallel rank ends the server (every stream
gets an error event within seconds, /health answers 503, the process exits non-zero and leaves no process
behind).

Each test starts its own server (a worker process is killed or stopped in it): about 6 s each here."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from server_fixtures import ServerProcess

TINY_TP2 = ("--dtype", "float32", "--tp", "2", "--kv-cache-memory", "4MiB")


def children(pid: int) -> list[int]:
    """The live processes whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def is_worker(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"multiprocessing.spawn" in cmdline and b"resource_tracker" not in cmdline


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def stream_until_error(server: ServerProcess, hurt) -> tuple[dict, float]:
    """Stream a long completion, call `hurt()` after the first token, and return the error event and
    the seconds from `hurt()` to it."""
    body = {"model": "m", "prompt": "Hello world", "max_tokens": 500, "ignore_eos": True, "stream": True,
            "temperature": 0}
    hurt_at = None
    with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return event["error"], time.monotonic() - hurt_at
            if hurt_at is None:
                hurt()
                hurt_at = time.monotonic()
    raise AssertionError(f"the stream ended without an error event{server.describe()}")


def assert_dies_cleanly(server: ServerProcess, workers: list[int], error: dict) -> None:
    """/health 503 naming the lost rank, then a non-zero exit, and no worker left."""
    assert error["code"] == 503 and "rank 1" in error["message"], error
    health = httpx.get(server.url + "/health", timeout=5)
    assert health.status_code == 503 and "the engine is dead" in health.text, health.text
    assert server.proc.wait(20) != 0, server.describe()
    time.sleep(0.2)
    assert not [pid for pid in workers if alive(pid)], "a worker outlived the server"
    assert "fw: error: " in server.log() and "rank 1" in server.log(), server.describe()


def start(tmp_path: Path, gqa_dir: Path, *extra: str) -> tuple[ServerProcess, list[int]]:
    server = ServerProcess(["--model", str(gqa_dir), "--served-model-name", "m", *TINY_TP2, *extra], tmp_path)
    server.wait_ready(120)
    workers = [pid for pid in children(server.proc.pid) if is_worker(pid)]
    assert len(workers) == 1, server.describe()
    return server, children(server.proc.pid)


def test_a_killed_worker_fails_the_stream_within_5_s_then_health_503_and_a_non_zero_exit(tmp_path, gqa_dir):
    server, procs = start(tmp_path, gqa_dir)
    try:
        worker = next(pid for pid in procs if is_worker(pid))
        error, seconds = stream_until_error(server, lambda: os.kill(worker, signal.SIGKILL))
        assert seconds < 5, seconds
        assert "killed by SIGKILL" in error["message"], error
        assert_dies_cleanly(server, procs, error)
    finally:
        server.kill()


def test_a_worker_killed_while_idle_turns_health_503_and_ends_the_server(tmp_path, gqa_dir):
    server, procs = start(tmp_path, gqa_dir)
    try:
        killed = time.monotonic()
        os.kill(next(pid for pid in procs if is_worker(pid)), signal.SIGKILL)
        while httpx.get(server.url + "/health", timeout=5).status_code == 200:
            assert time.monotonic() - killed < 5, "still healthy 5 s after its worker died"
            time.sleep(0.05)
        assert server.proc.wait(20) != 0, server.describe()
        assert not [pid for pid in procs if alive(pid)]
    finally:
        server.kill()


@pytest.mark.slow
def test_a_stopped_worker_fails_the_stream_within_10_s_with_dist_timeout_5(tmp_path, gqa_dir):
    server, procs = start(tmp_path, gqa_dir, "--dist-timeout", "5")
    worker = next(pid for pid in procs if is_worker(pid))
    try:
        error, seconds = stream_until_error(server, lambda: os.kill(worker, signal.SIGSTOP))
        assert seconds < 10, seconds
        assert "--dist-timeout 5 s" in error["message"], error
        assert_dies_cleanly(server, procs, error)
    finally:
        if alive(worker):
            os.kill(worker, signal.SIGCONT)
        server.kill()


# -- data parallelism: two replicas behind one server ---------------------------------------------

DP_PROMPTS = ["Hello world", "The engine schedules every request in pages.", "Once upon a time",
              "汉字测试：你好", "A B C D E F", "Numbers: 1 2 3 4", "The quick brown fox", "Why is the sky blue?"]


def complete_all(server: ServerProcess, prompts: list[str], max_tokens: int = 16) -> list[str]:
    """The prompts sent at once (one thread each); each greedy answer's text."""
    from concurrent.futures import ThreadPoolExecutor

    def one(prompt: str) -> str:
        body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
        response = httpx.post(server.base_url + "/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def replica_metric(server: ServerProcess, name: str) -> dict[str, float]:
    from server_fixtures import metric_samples

    text = server.metrics_text()
    return {r: metric_samples(text, name, replica=r)[0] for r in ("0", "1")}


def test_dp2_spreads_a_load_over_both_replicas_and_keeps_serving_when_one_dies(tmp_path, gqa_dir, llm):
    from fw import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = [o.outputs[0].text for o in llm.generate(DP_PROMPTS, params)]
    server = ServerProcess(["--model", str(gqa_dir), "--served-model-name", "m", "--dtype", "float32",
                            "--kv-cache-memory", "4MiB", "--dp", "2"], tmp_path)
    try:
        server.wait_ready(120)
        replicas = [pid for pid in children(server.proc.pid) if is_worker(pid)]
        assert len(replicas) == 1, server.describe()  # replica 0 runs in the server's own process
        assert complete_all(server, DP_PROMPTS) == expected
        served = replica_metric(server, "fw_replica_requests_total")
        assert served["0"] >= 2 and served["1"] >= 2 and sum(served.values()) == len(DP_PROMPTS), served

        os.kill(replicas[0], signal.SIGKILL)
        time.sleep(0.5)
        assert complete_all(server, DP_PROMPTS[:4]) == expected[:4]  # replica 0 answers them all
        health = httpx.get(server.url + "/health", timeout=5)
        assert health.status_code == 200 and health.json()["status"] == "degraded", health.text
        assert replica_metric(server, "fw_replica_up") == {"0": 1.0, "1": 0.0}
        assert "data-parallel replica 1 (pid" in server.log() and "killed by SIGKILL" in server.log()
        server.stop(20)
    finally:
        server.kill()
    assert not [pid for pid in replicas if alive(pid)]
