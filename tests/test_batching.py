"""Continuous batching: sequences join and leave the running batch step by step,
and no sequence's output depends on what else shares its steps. Also request
validation, which must reject a bad request before it touches the scheduler."""

from __future__ import annotations

import pytest

from conftest import record_steps
from fw import SamplingParams
from fw.errors import InvalidRequestError, PromptTooLongError

PROMPTS = [
    "Hello world",
    "The engine schedules every request in pages",
    "Once upon a time, in a small village by the river",
    "def add(a, b):",
]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def alone(llm, prompt, params: SamplingParams) -> list[int]:
    """The reference: the request with nothing else in the engine."""
    assert not llm.engine.has_unfinished_requests()
    return llm.generate([prompt], params)[0].outputs[0].token_ids


def run_until_done(engine, max_steps: int = 500) -> tuple[dict[str, int], dict[str, object]]:
    """Step the engine until idle; return the step at which each request finished and its final output."""
    finished_at, final = {}, {}
    for step in range(max_steps):
        if not engine.has_unfinished_requests():
            return finished_at, final
        for out in engine.step():
            if out.finished:
                finished_at[out.request_id] = step
                final[out.request_id] = out
    raise AssertionError("engine did not finish")


def test_requests_with_different_max_tokens_finish_independently(fresh_llm):
    llm = fresh_llm()
    engine = llm.engine
    lengths = {"short": 3, "medium": 9, "long": 20}
    for (rid, n), prompt in zip(lengths.items(), PROMPTS):
        engine.add_request(rid, prompt=prompt, params=greedy(n))
    running_when_short_finished = []
    original_finish = engine.scheduler.finish

    def finish(seq):
        if seq.request.request_id == "short":
            running_when_short_finished.extend(s.request.request_id for s in engine.scheduler.running)
        original_finish(seq)

    engine.scheduler.finish = finish
    steps = record_steps(llm)
    finished_at, final = run_until_done(engine)

    assert finished_at["short"] < finished_at["medium"] < finished_at["long"]
    # All three prefilled together in step 0; each then decodes one token per step.
    assert finished_at == {rid: n - 1 for rid, n in lengths.items()}
    assert set(running_when_short_finished) == {"short", "medium", "long"}
    # The batch shrinks as each one leaves, and the others go on decoding.
    assert [len(s) for s in steps] == [3] * 3 + [2] * 6 + [1] * 11
    for (rid, n), prompt in zip(lengths.items(), PROMPTS):
        out = final[rid].outputs[0]
        assert len(out.token_ids) == n and out.finish_reason == "length"
        assert out.token_ids == alone(llm, prompt, greedy(n))
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_late_request_joins_the_running_batch(fresh_llm):
    llm = fresh_llm()
    engine = llm.engine
    steps = record_steps(llm)
    engine.add_request("early-0", prompt=PROMPTS[0], params=greedy(16))
    engine.add_request("early-1", prompt=PROMPTS[1], params=greedy(16))
    for _ in range(5):
        engine.step()
    assert [len(s.output_token_ids) for s in engine.scheduler.running] == [5, 5]

    engine.add_request("late", prompt=PROMPTS[2], params=greedy(8))
    join_step = len(steps)
    engine.step()
    # The late prefill ran in the same forward pass as the two decodes, and it stays in the batch.
    assert sorted(steps[join_step]) == [1, 1, len(engine.requests["late"].prompt_token_ids)]
    assert len(engine.scheduler.running) == 3
    engine.step()
    assert steps[join_step + 1] == [1, 1, 1]

    _, final = run_until_done(engine)
    assert final["late"].outputs[0].token_ids == alone(llm, PROMPTS[2], greedy(8))
    assert final["early-0"].outputs[0].token_ids == alone(llm, PROMPTS[0], greedy(16))
    assert final["early-1"].outputs[0].token_ids == alone(llm, PROMPTS[1], greedy(16))


def test_outputs_do_not_depend_on_batch_composition(fresh_llm):
    """Many requests of mixed lengths under a small step budget equal each request run alone."""
    llm = fresh_llm(max_batch_input_tokens=16, max_batch_size=3, kv_cache_page_size=8)
    steps = record_steps(llm)
    prompts = PROMPTS + ["a", "汉字测试：你好，世界！"]
    params = [greedy(n) for n in (4, 12, 7, 20, 1, 9)]
    batched = llm.generate(prompts, params)
    assert max(len(s) for s in steps) == 3 and max(sum(s) for s in steps) == 16
    for prompt, p, out in zip(prompts, params, batched):
        assert out.outputs[0].token_ids == alone(llm, prompt, p)


def test_abort_request_frees_its_pages_and_leaves_others_running(fresh_llm):
    llm = fresh_llm(kv_cache_page_size=4)
    engine = llm.engine
    engine.add_request("keep", prompt=PROMPTS[0], params=greedy(10))
    engine.add_request("drop", prompt=PROMPTS[1], params=greedy(10))
    engine.step()
    engine.step()
    out = engine.abort_request("drop")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert [s.request.request_id for s in engine.scheduler.running] == ["keep"]
    _, final = run_until_done(engine)
    assert set(final) == {"keep"}
    assert final["keep"].outputs[0].token_ids == alone(llm, PROMPTS[0], greedy(10))
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert engine.abort_request("drop") is None


def test_shared_params_without_max_tokens_serve_prompts_of_any_length(fresh_llm, tokenizer):
    """max_tokens=None means "up to the context length" for each prompt on its own."""
    llm = fresh_llm(max_length=40)
    short, long = "a", "Once upon a time, in a small village by the river"
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    outs = llm.generate([short, long], params)
    assert params.max_tokens is None, "the caller's SamplingParams must not be modified"
    for out in outs:
        assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 40
        assert out.outputs[0].finish_reason == "length"


# -- validation ------------------------------------------------------------------------------


def assert_engine_idle(llm) -> None:
    engine = llm.engine
    assert not engine.requests and not engine.scheduler.has_work()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_empty_prompt_is_rejected(llm):
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([[]], SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate({"prompt_token_ids": []}, SamplingParams(max_tokens=4))
    assert_engine_idle(llm)


def test_a_bad_prompt_in_a_batch_leaves_no_request_behind(llm):
    """generate() adds prompts one by one; when one is rejected, the ones before it must not stay
    queued in the engine (they would run, unseen, inside the next call)."""
    with pytest.raises(InvalidRequestError):
        llm.generate(["Hello world", [], "def add(a, b):"], SamplingParams(max_tokens=4))
    assert_engine_idle(llm)
    assert len(llm.generate("Hello world", greedy(3))[0].outputs[0].token_ids) == 3


def test_prompt_longer_than_max_length_is_rejected_with_both_numbers(fresh_llm):
    llm = fresh_llm(max_length=32)
    with pytest.raises(PromptTooLongError) as err:
        llm.generate([[5] * 45], SamplingParams(max_tokens=1))
    assert "45" in str(err.value) and "32" in str(err.value)
    assert_engine_idle(llm)


def test_max_tokens_beyond_max_length_is_rejected_with_the_numbers(fresh_llm):
    llm = fresh_llm(max_length=32)
    with pytest.raises(PromptTooLongError) as err:
        llm.generate([[5] * 10], SamplingParams(max_tokens=30))
    message = str(err.value)
    assert "10" in message and "30" in message and "32" in message
    assert_engine_idle(llm)
    # The largest allowed max_tokens is accepted and runs to the limit.
    out = llm.generate([[5] * 10], SamplingParams(max_tokens=22, temperature=0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 22


def test_request_larger_than_the_whole_kv_cache_is_rejected(fresh_llm):
    llm = fresh_llm(num_kv_blocks=4, kv_cache_page_size=4)
    with pytest.raises(PromptTooLongError) as err:
        llm.generate([[5] * 10], SamplingParams(max_tokens=10))
    assert "20" in str(err.value) and "16" in str(err.value)
    assert_engine_idle(llm)


def test_token_ids_outside_the_vocabulary_are_rejected(llm):
    with pytest.raises(InvalidRequestError, match="512"):
        llm.generate([[1, 2, 512]], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError):
        llm.generate([[1, -1]], SamplingParams(max_tokens=2))
    assert_engine_idle(llm)


def test_duplicate_request_id_is_rejected(fresh_llm):
    llm = fresh_llm()
    llm.engine.add_request("same", prompt="a", params=greedy(2))
    with pytest.raises(InvalidRequestError, match="same"):
        llm.engine.add_request("same", prompt="b", params=greedy(2))
    run_until_done(llm.engine)


def test_a_cpu_engine_steps_within_the_cpu_default_budget(fresh_llm):
    """Without --max-batch-input-tokens a CPU engine's steps hold at most CPU_STEP_TOKENS tokens (512, chosen
    in docs/performance.md: at 2,048 one long prompt held every decoding stream for a whole long step)."""
    from fw.config import CPU_STEP_TOKENS

    llm = fresh_llm(max_batch_size=8)
    assert llm.engine.loaded.device.type == "cpu"
    assert llm.engine.scheduler.max_batch_tokens == llm.engine.scheduler.chunk_size == CPU_STEP_TOKENS == 512
    steps = record_steps(llm)
    llm.generate([[5 + i % 50 for i in range(300)]] * 2 + [[7] * 200] * 2, greedy(2))
    assert sum(steps[0]) == CPU_STEP_TOKENS and max(sum(s) for s in steps) <= CPU_STEP_TOKENS  # 1,000 split
