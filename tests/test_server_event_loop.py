"""A 1.9 MB chat message must not stall other streams (issue 21): the chat template is rendered
and the prompt tokenized on the tokenizer's worker thread, not on the server's event loop, where
it froze every stream for 3-6 s. A real `fw serve` on the tiny model at
its default thread count (2 on this machine: the engine's steps leave the tokenizer thread a core, as a
step's second thread descheduled by it had stretched the gaps to 0.71 s); one client streams without pause
while another sends the message, and the stream's largest gap between chunks stays small."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from server_fixtures import assert_error_body, running_server

MESSAGE_BYTES = 1_900_000
MAX_GAP = 0.5  # seconds, the acceptance bound
# On a machine loaded by others every gap grows: the bound is MAX_GAP or this many times the largest gap of
# the USUAL_S seconds before the message, whichever is larger. A stall of the old kind (10x the usual
# gap) fails either way.
NOISE_FACTOR = 3
USUAL_S = 2.0  # seconds of streaming measured before the message


@pytest.fixture(scope="module")
def server(gqa_dir, tmp_path_factory):
    # --max-input-tokens far above the message's ~900,000 tokens' worth of bytes: the message passes the
    # byte bound, so it is rendered and tokenized in full (then refused for its token count).
    args = ["--model", str(gqa_dir), "--num-kv-blocks", "64", "--dtype", "float32", "--attention-backend", "sdpa",
            "--max-input-tokens", "500000"]
    with running_server(args, tmp_path_factory.mktemp("tiny_event_loop")) as s:
        yield s


def _stream_until(server, stop: threading.Event, events: list[float], problems: list[str]) -> None:
    """Back-to-back streams until `stop`, recording when each starts and when each line arrives.
    Token-id prompts: they need no tokenizer, so only the event loop stands between engine and client."""
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        while not stop.is_set():
            events.append(time.monotonic())
            with http.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    problems.append(f"{r.status_code}: {r.read()!r}")
                    return
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(time.monotonic())
                        if '"error"' in line:
                            problems.append(line)


def test_a_huge_chat_message_does_not_stall_other_streams(server):
    stop, events, problems = threading.Event(), [], []
    streamer = threading.Thread(target=_stream_until, args=(server, stop, events, problems))
    streamer.start()
    try:
        deadline = time.monotonic() + 30
        while len(events) < 50 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(events) >= 50, "the stream did not start"
        time.sleep(USUAL_S)  # the usual gaps, for the bound on a loaded machine
        message = ("the engine schedules every request " * (MESSAGE_BYTES // 35 + 1))[:MESSAGE_BYTES]
        sent = time.monotonic()
        r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                       json={"messages": [{"role": "user", "content": message}], "max_tokens": 4})
        answered = time.monotonic()
        time.sleep(0.2)
    finally:
        stop.set()
        streamer.join(60)
    assert not problems, problems
    err = assert_error_body(r, 400)  # tokenized in full, then refused for its length
    assert "tokens" in err["message"], err
    assert events[0] < sent and events[-1] > answered, "the stream did not cover the big request"
    window = [t for t in events if sent - 0.5 <= t <= answered + 0.2]
    gap = max(b - a for a, b in zip(window, window[1:]))
    before = [t for t in events if sent - 0.5 - USUAL_S <= t < sent - 0.5]
    usual = max(b - a for a, b in zip(before, before[1:]))
    bound = max(MAX_GAP, NOISE_FACTOR * usual)
    print(f"\nlargest inter-chunk gap while a {MESSAGE_BYTES} byte chat message was handled "
          f"({answered - sent:.2f} s): {gap:.3f} s; before it: {usual:.3f} s")
    assert gap < bound, f"a stream stalled for {gap:.2f} s while the message was rendered and tokenized " \
                        f"(the largest gap before it: {usual:.2f} s)"
