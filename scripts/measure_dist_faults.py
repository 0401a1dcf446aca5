"""Failure-detection latency of `fw serve` (issue 22, docs/distributed.md): a tensor-parallel worker SIGKILLed or
SIGSTOPped (with --dist-timeout 5) mid-stream, and a data-parallel replica SIGKILLed mid-stream: seconds from the
signal to the client's error event, to /health 503, and to the server's exit (and its code).

    python scripts/measure_dist_faults.py MODEL_DIR [ROUNDS]    # a small model whose heads divide by 2; ROUNDS: 2
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from server_fixtures import ServerProcess  # noqa: E402  (the tests' server helpers)
from test_distributed_server import children, is_worker  # noqa: E402

KINDS = {"kill": (["--tp", "2"], signal.SIGKILL), "stop": (["--tp", "2", "--dist-timeout", "5"], signal.SIGSTOP),
         "dp": (["--dp", "2"], signal.SIGKILL)}


def _stream(server: ServerProcess, prompt: str, started: threading.Event, errors: list[float]) -> None:
    body = {"model": "m", "prompt": prompt, "max_tokens": 500, "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                if "error" in json.loads(line[6:]):
                    errors.append(time.monotonic())
                started.set()


def measure(model: str, kind: str) -> dict:
    flags, sig = KINDS[kind]
    server = ServerProcess(["--model", model, "--served-model-name", "m", "--dtype", "float32",
                            "--kv-cache-memory", "4MiB", *flags], Path(tempfile.mkdtemp(prefix=f"fw-faults-{kind}-")))
    server.wait_ready(180)
    victim = next(pid for pid in children(server.proc.pid) if is_worker(pid))
    prompts = ["Hello world", "Once upon a time"] if kind == "dp" else ["Hello world"]  # DP: one on each replica
    started, errors = threading.Event(), []
    streams = [threading.Thread(target=_stream, args=(server, p, started, errors)) for p in prompts]
    for thread in streams:
        thread.start()
    started.wait(60)
    time.sleep(0.2)
    hurt = time.monotonic()
    os.kill(victim, sig)
    for thread in streams:
        thread.join(60)
    result = {"error_event_s": errors[0] - hurt if errors else None}
    try:
        if kind == "dp":
            result["health"] = httpx.get(server.url + "/health", timeout=5).text
            server.stop(30)
            return result
        while True:
            try:
                if httpx.get(server.url + "/health", timeout=2).status_code == 503:
                    result["health_503_s"] = time.monotonic() - hurt
                    break
            except httpx.TransportError:  # already gone
                break
            time.sleep(0.01)
        result["exit_code"] = server.proc.wait(30)
        result["exit_s"] = time.monotonic() - hurt
        return result
    finally:
        server.kill()
        if sig == signal.SIGSTOP:
            try:
                os.kill(victim, signal.SIGCONT)
            except OSError:
                pass


def main() -> None:
    model, rounds = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2
    results: dict[str, list[dict]] = {}
    for _ in range(rounds):
        for kind in KINDS:
            results.setdefault(kind, []).append(measure(model, kind))
            print(kind, results[kind][-1], flush=True)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
