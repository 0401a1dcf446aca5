"""`fw bench`'s pure parts: statistics, prompt lengths and arrival schedules,
SSE decoding and chunk parsing, and per-request measurement from timestamps."""

from __future__ import annotations

import json
import math
import random

import pytest

from fw.commands.bench.prompts import WORDS, calibration_from_counts, make_prompt, sample_lengths, words_for_tokens
from fw.commands.bench.report import percentile, summarize, tpot
from fw.commands.bench.serve_load import BenchConfig, RequestResult, StreamRecorder, api_url, arrival_offsets, build_payload
from fw.commands.bench.sse import SSEDecoder, parse_chunk


# --- statistics ------------------------------------------------------------------------------------------------


def test_percentile_interpolates_like_numpy():
    values = [15.0, 20.0, 35.0, 40.0, 50.0]
    assert percentile(values, 0) == 15 and percentile(values, 100) == 50
    assert percentile(values, 50) == 35
    assert percentile(values, 40) == pytest.approx(29.0)  # rank 1.6: 20 + 0.6 * 15
    assert percentile(list(reversed(values)), 90) == pytest.approx(46.0)  # order of input does not matter
    assert percentile([7.0], 99) == 7.0
    data = [random.Random(3).random() for _ in range(101)]
    assert percentile(data, 99) == pytest.approx(sorted(data)[99])
    with pytest.raises(ValueError):
        percentile([], 50)


def test_summarize_always_has_every_key():
    stats = summarize([1.0, 2.0, 3.0, 4.0])
    assert stats["mean"] == 2.5 and stats["median"] == 2.5 and stats["min"] == 1 and stats["max"] == 4
    assert stats["p90"] == pytest.approx(3.7) and stats["p99"] == pytest.approx(3.97)
    assert stats["std"] == pytest.approx(math.sqrt(1.25))
    empty = summarize([])
    assert set(empty) == set(stats) and all(v is None for v in empty.values())


def test_tpot_excludes_the_first_token():
    r = RequestResult(0, 10, 10, ttft=0.2, latency=1.1, output_tokens=10, success=True)
    assert tpot(r) == pytest.approx(0.1)
    assert tpot(RequestResult(0, 10, 10, ttft=0.2, latency=0.2, output_tokens=1)) is None
    assert tpot(RequestResult(0, 10, 10, ttft=None, latency=0.2, output_tokens=5)) is None


# --- prompts and schedule ----------------------------------------------------------------------------------------


def test_lengths_are_uniform_over_the_range():
    lengths = sample_lengths(128, 0.5, 4000, random.Random(0))
    assert min(lengths) == 64 and max(lengths) == 192
    assert sum(lengths) / len(lengths) == pytest.approx(128, rel=0.03)
    assert sample_lengths(128, 0.0, 5, random.Random(0)) == [128] * 5
    assert set(sample_lengths(2, 0.9, 200, random.Random(0))) == {1, 2, 3, 4}  # never below 1
    with pytest.raises(ValueError):
        sample_lengths(10, 1.0, 1, random.Random(0))


def test_prompts_are_seeded_words():
    a = make_prompt(50, random.Random(7))
    assert a == make_prompt(50, random.Random(7)) != make_prompt(50, random.Random(8))
    assert len(a.split()) == 50 and all(w in WORDS for w in a.split())
    assert words_for_tokens(130, 1.3) == 100 and words_for_tokens(1, 1.3) == 1


def test_calibration_cancels_per_prompt_overhead():
    # 1 BOS + 1.25 tokens/word: the difference sees only the per-word rate
    assert calibration_from_counts(200, 251, 400, 501) == pytest.approx(1.25)
    assert calibration_from_counts(200, 100, 400, 100) is None  # nonsense: fall back to the default
    assert calibration_from_counts(200, 100, 200, 300) is None


def test_arrivals_poisson_and_all_at_once():
    assert arrival_offsets(4, math.inf, 1.0, random.Random(0)) == [0.0] * 4
    offsets = arrival_offsets(3000, 10.0, 1.0, random.Random(0))
    assert offsets[0] == 0 and all(b >= a for a, b in zip(offsets, offsets[1:]))
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    mean = sum(gaps) / len(gaps)
    assert mean == pytest.approx(0.1, rel=0.06)
    assert math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) == pytest.approx(0.1, rel=0.1)  # exponential
    steady_offsets = arrival_offsets(3000, 10.0, 100.0, random.Random(0))
    steady_gaps = [b - a for a, b in zip(steady_offsets, steady_offsets[1:])]
    assert max(steady_gaps) < 0.2 and sum(steady_gaps) / len(steady_gaps) == pytest.approx(0.1, rel=0.05)
    assert offsets == arrival_offsets(3000, 10.0, 1.0, random.Random(0))


def test_payloads_and_urls():
    body = build_payload("completions", "m", "hi there", 16, 0.0, True, {"top_p": 0.9, "stream_options": None})
    assert body == {"model": "m", "prompt": "hi there", "max_tokens": 16, "temperature": 0.0, "stream": True,
                    "ignore_eos": True, "min_tokens": 16, "top_p": 0.9}
    chat = build_payload("chat", "m", "hi", 4, 0.5, False, {})
    assert chat["messages"] == [{"role": "user", "content": "hi"}] and "prompt" not in chat
    assert chat["stream_options"] == {"include_usage": True} and "ignore_eos" not in chat
    assert api_url("http://h:1/", "/v1/completions") == "http://h:1/v1/completions"
    assert api_url("http://h:1/v1", "/v1/chat/completions") == "http://h:1/v1/chat/completions"
    assert BenchConfig("u", endpoint="/v1/chat/completions").kind == "chat"
    assert BenchConfig("u").kind == "completions"


# --- server-sent events ---------------------------------------------------------------------------------------


def test_sse_decoder_survives_any_split():
    stream = ('data: {"x": "é"}\r\n\r\n: keep-alive comment\n\nevent: message\nid: 3\ndata:{"y": 1}\n\n'
              'retry: 10\ndata: [DONE]\n\n').encode()
    expected = ['{"x": "é"}', '{"y": 1}', "[DONE]"]
    for size in range(1, 12):  # every chunk size splits lines, \r\n pairs and the 2-byte é somewhere
        decoder = SSEDecoder()
        got = [p for i in range(0, len(stream), size) for p in decoder.feed(stream[i:i + size])]
        assert got + decoder.flush() == expected, size
    decoder = SSEDecoder()
    assert decoder.feed(b"data: a\rdata: b\rdata: tail") == ["a", "b"]  # lone CR ends lines too
    assert decoder.flush() == ["tail"]


def test_parse_chunk_completions_chat_usage_error():
    c = parse_chunk('{"choices": [{"index": 0, "text": " Paris", "finish_reason": null}]}')
    assert c.text == " Paris" and not c.done and c.completion_tokens is None
    role = parse_chunk('{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}')
    assert role.text == ""  # the role chunk carries no token
    last = parse_chunk('{"choices": [{"delta": {"content": "Hi"}, "finish_reason": "length"}]}')
    assert (last.text, last.finish_reason) == ("Hi", "length")
    assert parse_chunk('{"choices": [{"delta": {"reasoning_content": "hm"}}]}').text == "hm"
    usage = parse_chunk('{"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 12}}')
    assert (usage.prompt_tokens, usage.completion_tokens, usage.text) == (7, 12, "")
    assert parse_chunk("[DONE]").done
    assert parse_chunk('{"error": {"message": "boom", "code": 500}}').error == "boom"
    with pytest.raises(ValueError):
        parse_chunk("not json")
    with pytest.raises(ValueError):
        parse_chunk("[1, 2]")


def _text(t: str) -> str:
    return json.dumps({"choices": [{"index": 0, "text": t, "finish_reason": None}]})


def test_recorder_times_and_counts():
    r = StreamRecorder(RequestResult(0, 8, 4), started=10.0)
    assert not r.feed(json.dumps({"choices": [{"delta": {"role": "assistant", "content": ""}}]}), 10.05)
    for text, now in (("a", 10.2), ("b", 10.3), ("c", 10.45)):
        assert not r.feed(_text(text), now)
    assert not r.feed(json.dumps({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 6}}), 10.46)
    assert r.feed("[DONE]", 10.5)
    res = r.finish(10.5)
    assert res.success and res.error is None
    assert res.ttft == pytest.approx(0.2) and res.itl == pytest.approx([0.1, 0.15])
    assert res.latency == pytest.approx(0.5)
    assert (res.output_tokens, res.output_tokens_source, res.prompt_tokens) == (6, "usage", 9)

    no_usage = StreamRecorder(RequestResult(0, 8, 4), started=0.0)
    for i in range(3):
        no_usage.feed(_text("x"), 0.1 * (i + 1))
    no_usage.feed("[DONE]", 0.4)
    assert no_usage.finish(0.4).output_tokens == 3 and no_usage.result.output_tokens_source == "chunks"

    cut = StreamRecorder(RequestResult(0, 8, 4), started=0.0)
    cut.feed(_text("x"), 0.1)
    assert not cut.finish(0.2).success and "[DONE]" in cut.result.error
    finished = StreamRecorder(RequestResult(0, 8, 4), started=0.0)  # no [DONE], but the choice finished
    finished.feed(json.dumps({"choices": [{"text": "x", "finish_reason": "stop"}]}), 0.1)
    assert finished.finish(0.2).success

    failed = StreamRecorder(RequestResult(0, 8, 4), started=0.0)
    assert failed.feed('{"error": {"message": "out of memory"}}', 0.1)
    assert not failed.finish(0.1).success and "out of memory" in failed.result.error
