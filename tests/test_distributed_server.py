"""`fw serve` with several processes (issue 22): a lost tensor-parallel rank ends the server (every stream
gets an error event within seconds, /health answers 503, the process exits non-zero and leaves no process
behind).

Each test starts its own server (a worker process is killed or stopped in it): about 6 s each here."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from server_fixtures import ServerProcess, wait_for

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


@pytest.mark.slow
def test_a_worker_killed_while_idle_turns_health_503_and_ends_the_server(tmp_path, gqa_dir):
    server, procs = start(tmp_path, gqa_dir)
    try:
        killed = time.monotonic()
        os.kill(next(pid for pid in procs if is_worker(pid)), signal.SIGKILL)
        while httpx.get(server.url + "/health", timeout=5).status_code == 200:
            assert time.monotonic() - killed < 5, "still healthy 5 s after its worker died"
            time.sleep(0.05)
        assert server.proc.wait(20) != 0, server.describe()
        # its children end with it: the worker when stopped, the resource tracker once the server's pipe closes, a
        # moment after the server (the suite under load saw it alive right after the exit, as assert_dies_cleanly
        # allows for with its pause)
        wait_for(lambda: not [pid for pid in procs if alive(pid)], 2, message="no child of the server left")
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


def collect_stream(server: ServerProcess, prompt: str, events: list[dict]) -> None:
    """Stream a long completion into `events` (each chunk or error event) until it ends."""
    body = {"model": "m", "prompt": prompt, "max_tokens": 400, "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))


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

        # two long streams, one on each replica (the second goes where fewer tokens wait); replica 1 dies
        events: dict[int, list[dict]] = {0: [], 1: []}
        streams = [threading.Thread(target=collect_stream, args=(server, DP_PROMPTS[i], events[i])) for i in (0, 1)]
        for thread in streams:
            thread.start()
        wait_for(lambda: all(events.values()), 60, message="both streams started")
        os.kill(replicas[0], signal.SIGKILL)
        for thread in streams:
            thread.join(60)
        ends = sorted(("error" in e[-1]) for e in events.values())
        assert ends == [False, True], [e[-1] for e in events.values()]  # one finished, one failed
        error = next(e[-1]["error"] for e in events.values() if "error" in e[-1])
        assert error["code"] == 503 and "data-parallel replica 1 (pid" in error["message"], error
        assert complete_all(server, DP_PROMPTS[:4]) == expected[:4]  # replica 0 answers them all
        health = httpx.get(server.url + "/health", timeout=5)
        assert health.status_code == 200 and health.json()["status"] == "degraded", health.text
        assert replica_metric(server, "fw_replica_up") == {"0": 1.0, "1": 0.0}
        assert "data-parallel replica 1 (pid" in server.log() and "killed by SIGKILL" in server.log()
        server.stop(20)
    finally:
        server.kill()
    assert not [pid for pid in replicas if alive(pid)]


# -- launches: two `fw serve --nnodes 2` processes, torchrun -------------------------------------


def expected_texts(llm, prompts: list[str], max_tokens: int = 16) -> list[str]:
    from fw import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(prompts, params)]


@pytest.mark.slow
def test_two_fw_serve_nodes_give_the_tokens_of_one_process(tmp_path, gqa_dir, llm):
    """`fw serve --nnodes 2 --node-rank 0|1 --dist-init-addr 127.0.0.1:PORT`: node 0 serves, node 1 runs rank 1."""
    import subprocess
    import sys

    from server_fixtures import free_port, server_env

    addr = f"127.0.0.1:{free_port()}"
    flags = ["--model", str(gqa_dir), "--dtype", "float32", "--kv-cache-memory", "4MiB", "--tp", "2", "--nnodes", "2",
             "--dist-init-addr", addr]
    node1 = subprocess.Popen([sys.executable, "-m", "fw.cli.main", "serve", *flags, "--node-rank", "1"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=server_env())
    server = ServerProcess(["--served-model-name", "m", *flags, "--node-rank", "0"], tmp_path)
    try:
        server.wait_ready(120)
        assert not [pid for pid in children(server.proc.pid) if is_worker(pid)]  # node 0 holds rank 0 only
        assert complete_all(server, DP_PROMPTS[:4]) == expected_texts(llm, DP_PROMPTS[:4])
        server.stop(20)
        output, _ = node1.communicate(timeout=30)
        assert node1.returncode == 0, output
    finally:
        server.kill()
        if node1.poll() is None:
            node1.kill()
            node1.wait()


def test_torchrun_two_processes_give_the_tokens_of_one_process(tmp_path, gqa_dir, llm):
    """`torchrun --nproc-per-node 2 -m fw.cli.main serve ...`: rank 0 serves, rank 1 is a worker in
    torchrun's second process; they meet in torchrun's store. --tp is taken from WORLD_SIZE."""
    import subprocess
    import sys

    from server_fixtures import free_port, server_env

    port = free_port()
    torchrun = Path(sys.executable).parent / "torchrun"
    log = tmp_path / "torchrun.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(torchrun), "--nproc-per-node", "2", "-m", "fw.cli.main", "serve", "--host",
                                 "127.0.0.1", "--port", str(port), "--model", str(gqa_dir), "--served-model-name", "m",
                                 "--dtype", "float32", "--kv-cache-memory", "4MiB"],
                                stdout=out, stderr=subprocess.STDOUT, env=server_env(), cwd=tmp_path)
    server = ServerProcess.__new__(ServerProcess)  # only its HTTP helpers: the process is torchrun's
    server.url, server.base_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port}/v1"
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            try:
                if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        ranks = children(proc.pid)
        assert len(ranks) == 2, log.read_text()  # both ranks are torchrun's processes, no fw-spawned worker
        assert not [pid for rank in ranks for pid in children(rank) if is_worker(pid)]
        assert complete_all(server, DP_PROMPTS[:4]) == expected_texts(llm, DP_PROMPTS[:4])
        assert "tensor parallel: 2 ranks joined" in log.read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    time.sleep(0.5)
    assert not [pid for pid in ranks if alive(pid)], log.read_text()
