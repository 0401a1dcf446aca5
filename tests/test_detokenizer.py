"""Incremental detokenization and streaming: deltas add up to the final text,
multi-byte characters are never cut, stop strings never leak into a delta, and
closing a stream early aborts the request and frees its pages.

Exact token sequences come from a scripted final-choice sampler (the same
contract a sampler plugin implements), so the text is known in advance."""

from __future__ import annotations

import contextlib

import pytest
import torch

from fw import SamplingParams
from fw.engine.detokenizer import IncrementalDetokenizer
from tiny_models import byte_token_ids

PROMPTS = ["Hello world", "The engine schedules every request", "汉字测试：你好", "def add(a, b):"]
EOS = 2


class ScriptedChoice:
    """Emit script[i] as the i-th generated token of every sequence."""

    def __init__(self, script: list[int]):
        self.script = script

    def choose(self, logits: torch.Tensor, batch) -> torch.Tensor:
        return torch.tensor([self.script[s.num_output_tokens] for s in batch.seqs], device=logits.device)


def scripted_llm(fresh_llm, script: list[int], **options):
    llm = fresh_llm(**options)
    llm.engine.sampler.chooser = ScriptedChoice(script)
    return llm


def collect(stream) -> tuple[list[str], list[int], list]:
    texts, ids, outs = [], [], []
    for out in stream:
        texts.append(out.outputs[0].text)
        ids.extend(out.outputs[0].token_ids)
        outs.append(out)
    return texts, ids, outs


def params(n: int, **extra) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **extra)


# -- streaming from the real model ---------------------------------------------------------------


@pytest.mark.parametrize("prompt", PROMPTS)
def test_stream_deltas_add_up_to_the_generated_output(llm, prompt):
    whole = llm.generate(prompt, params(20))[0].outputs[0]
    texts, ids, outs = collect(llm.stream(prompt, params(20)))
    assert "".join(texts) == whole.text
    assert ids == whole.token_ids
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert outs[-1].outputs[0].finish_reason == "length"
    assert all(o.outputs[0].finish_reason is None for o in outs[:-1])
    assert len(outs) > 1


def test_stream_with_a_stop_string_adds_up_to_the_truncated_output(llm):
    text = llm.generate(PROMPTS[1], params(24))[0].outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 4]
    whole = llm.generate(PROMPTS[1], params(24, stop=stop))[0].outputs[0]
    texts, _, outs = collect(llm.stream(PROMPTS[1], params(24, stop=stop)))
    assert "".join(texts) == whole.text == text[:text.index(stop)]
    assert outs[-1].outputs[0].stop_reason == stop


def test_closing_a_stream_early_aborts_and_frees_pages(fresh_llm):
    llm = fresh_llm(kv_cache_page_size=4)
    engine = llm.engine
    stream = llm.stream(PROMPTS[1], params(200))
    with contextlib.closing(stream):
        for _ in range(3):
            out = next(stream)
            assert not out.finished
        assert engine.blocks.num_free_blocks < engine.blocks.num_blocks
        assert engine.has_unfinished_requests()
    assert not engine.has_unfinished_requests()
    assert not engine.scheduler.has_work()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    # The engine is still usable, and the aborted request left nothing behind.
    assert llm.generate(PROMPTS[0], params(4))[0].outputs[0].finish_reason == "length"
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_stream_leaves_other_requests_running(fresh_llm):
    llm = fresh_llm()
    other = llm.engine.add_request("other", prompt=PROMPTS[0], params=params(30))
    texts, _, _ = collect(llm.stream(PROMPTS[1], params(5)))
    assert texts
    assert not other.finished
    assert llm.engine.has_unfinished_requests()
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert other.seqs[0].num_output_tokens == 30


class PerIndexScript:
    """Emit scripts[seq.index][i] as the i-th generated token of each of a request's n sequences."""

    def __init__(self, scripts: list[list[int]]):
        self.scripts = scripts

    def choose(self, logits: torch.Tensor, batch) -> torch.Tensor:
        return torch.tensor([self.scripts[s.index][s.num_output_tokens] for s in batch.seqs], device=logits.device)


def test_stream_with_n_keeps_every_sequences_deltas(fresh_llm, tokenizer):
    """Sequence 0 stops early (EOS); sequence 1's later deltas must still be streamed."""
    short = byte_token_ids(tokenizer, "ab") + [EOS] + byte_token_ids(tokenizer, "zzzzzzzz")
    long = byte_token_ids(tokenizer, "the second sequence goes on")
    llm = fresh_llm()
    llm.engine.sampler.chooser = PerIndexScript([short, long])
    p = SamplingParams(n=2, max_tokens=len(long), temperature=0)
    whole = llm.generate(PROMPTS[0], p)[0].outputs
    assert [c.text for c in whole] == ["ab", "the second sequence goes on"]
    streamed = {0: "", 1: ""}
    for out in llm.stream(PROMPTS[0], p):
        for c in out.outputs:
            streamed[c.index] += c.text
    assert streamed == {0: "ab", 1: "the second sequence goes on"}


# -- multi-byte characters -----------------------------------------------------------------------

MULTIBYTE = "Hi 🙂 你好, café! 🚀 日本語 ❤️"


def test_streamed_multibyte_characters_are_never_cut(fresh_llm, tokenizer):
    script = byte_token_ids(tokenizer, MULTIBYTE)  # one token per byte: every character is split
    assert len(script) > len(MULTIBYTE)
    llm = scripted_llm(fresh_llm, script)
    texts, ids, outs = collect(llm.stream(PROMPTS[0], params(len(script))))
    assert ids == script
    assert "".join(texts) == MULTIBYTE
    for delta in texts:
        assert "\ufffd" not in delta
    # Some deltas carry tokens but no text yet: the bytes of a character still being completed.
    assert any(not o.outputs[0].text and o.outputs[0].token_ids for o in outs)
    assert llm.generate(PROMPTS[0], params(len(script)))[0].outputs[0].text == MULTIBYTE


def test_multibyte_text_from_merged_tokens(fresh_llm, tokenizer):
    script = tokenizer(MULTIBYTE, add_special_tokens=False).input_ids
    llm = scripted_llm(fresh_llm, script)
    texts, ids, _ = collect(llm.stream(PROMPTS[2], params(len(script))))
    assert "".join(texts) == MULTIBYTE == tokenizer.decode(ids)
    assert all("\ufffd" not in t for t in texts)


def test_detokenizer_pieces_are_whole_characters(tokenizer):
    text = "汉字测试：你好，世界！ Emoji 🙂😀🚀 — naïve"
    for ids in (tokenizer(text, add_special_tokens=False).input_ids, byte_token_ids(tokenizer, text)):
        detok = IncrementalDetokenizer(tokenizer, tokenizer("prompt").input_ids, [], True)
        seen = []
        for token in ids:
            before = detok.text
            detok.add_token(token)
            assert detok.text.startswith(before)
            seen.append(detok.text[len(before):])
        assert all("\ufffd" not in piece for piece in seen)
        assert "".join(seen) == detok.text == text


# -- stop strings across token boundaries --------------------------------------------------------


@pytest.mark.parametrize("text,stop,expected", [
    ("Hello STAR then STOP after", "STOP", "Hello STAR then "),  # a false start ("ST") is released
    ("abcabcabd tail", "abcabd", "abc"),  # the match starts inside an earlier partial match
    ("你好世界再见", "世界", "你好"),  # a stop string of multi-byte characters, split over bytes
    ("x 🙂🚀 y", "🚀", "x 🙂"),
])
@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_spanning_tokens_never_leak_into_deltas(fresh_llm, tokenizer, text, stop, expected, include):
    script = byte_token_ids(tokenizer, text)
    llm = scripted_llm(fresh_llm, script)
    p = params(len(script), stop=[stop], include_stop_str_in_output=include)
    texts, ids, outs = collect(llm.stream(PROMPTS[0], p))
    want = expected + stop if include else expected
    assert "".join(texts) == want
    assert all("\ufffd" not in t for t in texts)
    last = outs[-1].outputs[0]
    assert (last.finish_reason, last.stop_reason) == ("stop", stop)
    assert ids == script[:len(ids)] and len(ids) < len(script)
    assert llm.generate(PROMPTS[0], p)[0].outputs[0].text == want


def test_stop_string_prefix_is_held_back_then_released(fresh_llm, tokenizer):
    script = byte_token_ids(tokenizer, "Hello STAR!")
    llm = scripted_llm(fresh_llm, script)
    visible = []
    for out in llm.stream(PROMPTS[0], params(len(script), stop="STOP")):
        visible.append("".join(visible[-1:]) + out.outputs[0].text if visible else out.outputs[0].text)
    # "S" and "ST" could still become "STOP": they are shown only once the "A" rules that out.
    assert "Hello S" not in visible and "Hello ST" not in visible
    assert "Hello STA" in visible
    assert visible[-1] == "Hello STAR!"


# -- special tokens ------------------------------------------------------------------------------


def test_special_tokens_are_skipped_unless_asked_for(fresh_llm, tokenizer):
    script = byte_token_ids(tokenizer, "Hi") + [EOS] + byte_token_ids(tokenizer, "!")
    llm = scripted_llm(fresh_llm, script)
    skipped = llm.generate(PROMPTS[0], params(len(script)))[0].outputs[0]
    assert skipped.text == "Hi!" and skipped.token_ids == script
    kept = llm.generate(PROMPTS[0], params(len(script), skip_special_tokens=False))[0].outputs[0]
    assert kept.text == "Hi</s>!"
