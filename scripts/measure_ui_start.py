"""Issue 25's start-up figure: `fw serve` from process start to its first 200 on /health, with the chat
page (the default) and with --no-ui, the two alternating round by round; medians, then a GET / on the
page's server to show it serves (time to its first byte included); and, steadier on a busy machine, the
share of importing the page's route module in `import fw.server.app` (python -X importtime).

    .venv/bin/python scripts/measure_ui_start.py [--rounds 5] [-- fw serve flags...]

Without flags it serves the bundled SmolLM2 with a small KV cache. Run on an idle machine: start-up
figures drift with every other process (docs/performance.md)."""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

DEFAULT_FLAGS = ["--kv-cache-memory", "256MiB"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_to_health(flags: list[str], log_dir: str) -> tuple[float, float | None]:
    """Seconds from Popen to /health answering 200; with the page on, also the seconds GET / then took."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FW_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    with open(os.path.join(log_dir, f"serve-{port}.log"), "wb") as log:
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "fw.cli.main", "serve", "--host", "127.0.0.1", "--port",
                                 str(port), *flags], stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            while True:
                if proc.poll() is not None:
                    raise SystemExit(f"fw serve exited with {proc.returncode}; see {log.name}")
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.02)
            ready = time.perf_counter() - start
            page = None
            if "--no-ui" not in flags:
                t = time.perf_counter()
                r = httpx.get(f"http://127.0.0.1:{port}/", timeout=10)
                page = time.perf_counter() - t
                assert r.status_code == 200 and "<html" in r.text.lower(), r.status_code
            return ready, page
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def import_share() -> tuple[float, float]:
    """Milliseconds that importing the page's route module takes inside `import fw.server.app`, and the
    whole import, in a fresh interpreter (python -X importtime: cumulative microseconds per module)."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", "import fw.server.app"], capture_output=True,
                          text=True, check=True)
    cumulative = {}
    for line in done.stderr.splitlines():
        parts = [part.strip() for part in line.removeprefix("import time:").split("|")]
        if len(parts) == 3 and parts[1].isdigit():
            cumulative[parts[2]] = int(parts[1]) / 1000
    return cumulative["fw.server.routes.ui"], cumulative["fw.server.app"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("flags", nargs="*", help="fw serve flags (after --)")
    args = p.parse_args(argv)
    flags = args.flags or DEFAULT_FLAGS
    times: dict[str, list[float]] = {"page": [], "no-ui": []}
    first_page: list[float] = []
    with tempfile.TemporaryDirectory() as logs:
        start_to_health(flags, logs)  # warm the file cache for both
        for i in range(args.rounds):
            order = (("page", []), ("no-ui", ["--no-ui"])) if i % 2 == 0 else (("no-ui", ["--no-ui"]), ("page", []))
            for label, extra in order:
                ready, page = start_to_health([*flags, *extra], logs)
                times[label].append(ready)
                if page is not None:
                    first_page.append(page)
                print(f"round {i + 1}: {label:6} {ready:.3f} s to /health", flush=True)
        shares = [import_share() for _ in range(args.rounds)]
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"median of {args.rounds}: with the page {med['page']:.3f} s, --no-ui {med['no-ui']:.3f} s, "
          f"difference {med['page'] - med['no-ui']:+.3f} s; GET / afterwards {statistics.median(first_page) * 1000:.1f} ms")
    print(f"importing the page's routes: {statistics.median(s[0] for s in shares):.2f} ms of "
          f"{statistics.median(s[1] for s in shares):.0f} ms for fw.server.app (median of {args.rounds})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
