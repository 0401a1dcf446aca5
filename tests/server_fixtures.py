"""A real `fw serve` process for the server tests: started on a free port on 127.0.0.1, awaited
on /health, stopped with SIGTERM (its exit code checked), with its stdout and log kept in files so
a failing test can show what the server said.

Also small helpers every server test needs: an OpenAI error-body check, a /metrics reader, and the
`client` / `model` fixtures (an OpenAI SDK client for the module's `server` fixture, and the model it
serves) that a test module imports next to its own `server`."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import pytest

HOST = "127.0.0.1"
# The bundled model (no --model); the default 1 GiB of KV cache is wasteful here. fp32, because the tests
# compare batched with sequential greedy output: bf16 (the CPU default where it is native) rounds matmuls
# differently for different batch shapes, so a near-tie may break the other way (as in vLLM).
# Dense weights (--gguf-dequantize-at-load): these tests time the server, not the gguf method's per-matmul
# dequantization, which is several times slower (docs/choices.md).
SMOLLM2_ARGS = ("--kv-cache-memory", "256MiB", "--dtype", "float32", "--gguf-dequantize-at-load")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The caller's environment without FW_* settings (they would change the server's flags), offline."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FW_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
               HF_HUB_DISABLE_PROGRESS_BARS="1", PYTHONUNBUFFERED="1")
    env.update(extra or {})
    return env


class ServerProcess:
    """One `python -m fw.cli.main serve ...` subprocess listening on 127.0.0.1:`port`."""

    def __init__(self, args: list[str], log_dir: Path, env: dict[str, str] | None = None,
                 port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.base_url = self.url + "/v1"
        self.args = [sys.executable, "-m", "fw.cli.main", "serve", "--host", HOST, "--port", str(self.port), *args]
        log_dir.mkdir(parents=True, exist_ok=True)
        self.stdout_path = log_dir / f"serve-{self.port}.out"
        self.stderr_path = log_dir / f"serve-{self.port}.log"
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(self.args, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                         env=server_env(env), cwd=log_dir)

    # -- what it said -----------------------------------------------------------------------------

    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    def log(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def describe(self) -> str:
        """For assertion messages: the command line, exit status and the tail of its output."""
        return (f"\n$ {' '.join(self.args)}\nexit: {self.proc.poll()}\n--- stdout ---\n{self.stdout()[-3000:]}"
                f"\n--- log ---\n{self.log()[-6000:]}")

    # -- lifecycle --------------------------------------------------------------------------------

    def wait_ready(self, timeout: float = 120.0) -> "ServerProcess":
        """Poll /health until 200; fail with the server's log if it exits or takes too long."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"fw serve exited before it was ready{self.describe()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.kill()
        raise AssertionError(f"fw serve was not ready after {timeout:.0f} s{self.describe()}")

    def terminate(self) -> None:
        """Send SIGTERM (graceful shutdown) without waiting."""
        self.proc.send_signal(signal.SIGTERM)

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"fw serve did not exit within {timeout:.0f} s of SIGTERM{self.describe()}") from None

    def stop(self, timeout: float = 20.0, expect: int | None = 0) -> int:
        """SIGTERM, wait, and check the exit code (graceful shutdown exits 0)."""
        if self.proc.poll() is None:
            self.terminate()
        code = self.wait_exit(timeout)
        if expect is not None:
            assert code == expect, f"fw serve exited with {code}, expected {expect}{self.describe()}"
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    # -- HTTP -------------------------------------------------------------------------------------

    def client(self, api_key: str | None = None, timeout: float = 60.0) -> httpx.Client:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def metrics_text(self) -> str:
        r = httpx.get(self.url + "/metrics", timeout=10.0)
        assert r.status_code == 200, r.text
        return r.text


@contextmanager
def running_server(args: list[str] | tuple[str, ...], log_dir: Path, env: dict[str, str] | None = None,
                   ready_timeout: float = 120.0, stop_timeout: float = 20.0,
                   clean_log: bool = True) -> Iterator[ServerProcess]:
    """A ready server for the block; on exit it must shut down cleanly on SIGTERM (exit code 0),
    unless the block stopped it itself, and (with `clean_log`) its log must have no traceback:
    a request that failed inside the server shows there even when its client saw a tidy error."""
    server = ServerProcess(list(args), log_dir, env)
    try:
        server.wait_ready(ready_timeout)
        yield server
    except BaseException:
        server.kill()
        raise
    server.stop(stop_timeout)
    if clean_log:
        assert "Traceback" not in server.log(), f"the server logged a traceback{server.describe()}"


# -- checks shared by the server tests -------------------------------------------------------------


def assert_error_body(response: httpx.Response, status: int) -> dict:
    """An OpenAI-style error: the status, and {"error": {message, type, param, code}} with a message."""
    assert response.status_code == status, f"expected {status}, got {response.status_code}: {response.text[:500]}"
    body = response.json()
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert {"message", "type", "param", "code"} <= set(err), err
    assert isinstance(err["message"], str) and err["message"].strip(), err
    assert isinstance(err["type"], str) and err["type"], err
    return err


def metric_samples(text: str, name: str, **labels: str) -> list[float]:
    """Values of every sample called `name` whose labels include `labels` (Prometheus text format)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                out.append(sample.value)
    return out


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the matching samples (0 when there are none: a counter not yet incremented)."""
    return sum(metric_samples(text, name, **labels))


def wait_for(condition, timeout: float, interval: float = 0.05, message: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{message} not reached within {timeout} s")
        time.sleep(interval)


@pytest.fixture(scope="module")
def client(server):
    """The OpenAI SDK on the module's `server`; no retries, so a failure shows as itself."""
    import openai

    with openai.OpenAI(base_url=server.base_url, api_key="unused", timeout=120, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id
