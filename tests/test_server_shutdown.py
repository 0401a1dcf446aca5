"""SIGTERM while a request streams: `fw serve` stops taking new requests, lets the running one
finish, and exits 0 within --shutdown-timeout plus a few seconds. SmolLM2 (no --model), whose
decode is slow enough on CPU (about 50 ms a token) for a request to be caught in the middle."""

from __future__ import annotations

import json
import threading
import time

import httpx
from server_fixtures import SMOLLM2_ARGS, ServerProcess

SHUTDOWN_TIMEOUT = 20
MAX_TOKENS = 100  # about 5 s here: well inside SHUTDOWN_TIMEOUT


def _new_request_refused(server: ServerProcess) -> str:
    """How a new request fares during shutdown: 'refused' (no connection) or an HTTP status."""
    try:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
    except httpx.TransportError:
        return "refused"
    return str(r.status_code)


def test_sigterm_finishes_the_running_stream_then_exits_0(tmp_path):
    server = ServerProcess([*SMOLLM2_ARGS, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT)], tmp_path)
    try:
        server.wait_ready()
        body = {"prompt": "Tell me a long story about a lighthouse keeper.", "max_tokens": MAX_TOKENS,
                "ignore_eos": True, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        text, finish, usage, done, chunks = "", None, None, False, 0
        signalled_at = None
        during: list[str] = []
        with httpx.Client(base_url=server.url, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        continue
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    for c in chunk["choices"]:
                        text += c["text"]
                        finish = c["finish_reason"] or finish
                    chunks += 1
                    if chunks == 3:
                        server.terminate()
                        signalled_at = time.monotonic()
                        # a new request from another thread while this stream still runs
                        probe = threading.Thread(target=lambda: (time.sleep(0.5),
                                                                 during.append(_new_request_refused(server))))
                        probe.start()
        probe.join(15)
        assert signalled_at is not None
        assert during and during[0] in ("refused", "503"), during
        # the running request was not cut short
        assert done and finish == "length" and usage["completion_tokens"] == MAX_TOKENS, (finish, usage)
        assert text
        code = server.wait_exit(SHUTDOWN_TIMEOUT + 10)
        elapsed = time.monotonic() - signalled_at
        assert code == 0, server.describe()
        assert elapsed < SHUTDOWN_TIMEOUT + 5, f"exit took {elapsed:.1f} s"
        assert _new_request_refused(server) == "refused"
        assert "Traceback" not in server.log(), server.describe()
    finally:
        server.kill()


def test_sigterm_aborts_what_outlasts_the_shutdown_timeout(tmp_path):
    """A request longer than --shutdown-timeout does not hold the process: it exits 0 in time."""
    timeout = 2
    server = ServerProcess([*SMOLLM2_ARGS, "--shutdown-timeout", str(timeout)], tmp_path)
    try:
        server.wait_ready()
        body = {"prompt": "Tell me a long story.", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        lines: list[str] = []
        with httpx.Client(base_url=server.url, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                try:
                    for line in r.iter_lines():
                        lines.append(line)
                        if len(lines) == 3:
                            server.terminate()
                            signalled_at = time.monotonic()
                except httpx.TransportError:
                    pass  # the server may close the connection on the way out
        code = server.wait_exit(timeout + 15)
        elapsed = time.monotonic() - signalled_at
        assert code == 0, server.describe()
        assert elapsed < timeout + 5, f"exit took {elapsed:.1f} s"
        assert len([ln for ln in lines if ln.startswith("data: {")]) < 2000
        # The stream was ended, not cut: an error event saying why, then [DONE].
        events = [ln for ln in lines if ln.startswith("data: ")]
        assert events[-1] == "data: [DONE]", events[-3:]
        error = json.loads(events[-2][len("data: "):])["error"]
        assert error["code"] == 503 and error["type"] == "service_unavailable", error
        assert "--shutdown-timeout" in error["message"]
    finally:
        server.kill()
