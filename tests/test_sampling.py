"""Sampling: seeds, the truncation stages, penalties (checked against
transformers), logit bias, stop conditions, n, logprobs and parameter validation."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from fw import SamplingParams
from fw.errors import InvalidRequestError
from fw.sampling.batch import SamplingBatch
from fw.testing import FakeSequence as FakeSeq

PROMPTS = [
    "Hello world",
    "The engine schedules every request in pages of keys and values.",
    "Once upon a time, in a small village by the river",
    "def add(a, b):",
]
EOS = 2  # tiny_models' "</s>"


def greedy(max_tokens: int = 16, **extra) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **extra)


def sampled(seed: int | None, max_tokens: int = 16, **extra) -> SamplingParams:
    extra.setdefault("temperature", 1.0)
    return SamplingParams(seed=seed, max_tokens=max_tokens, ignore_eos=True, **extra)


def tokens(out) -> list[int]:
    return out.outputs[0].token_ids


# -- seeds ---------------------------------------------------------------------------------------


def test_seed_gives_the_same_output_whatever_else_is_in_the_batch(llm):
    target = sampled(seed=1234, max_tokens=24, temperature=0.9, top_k=50, top_p=0.95)
    alone = tokens(llm.generate(PROMPTS[1], target)[0])
    crowd = [
        sampled(seed=None, max_tokens=30),
        greedy(10),
        sampled(seed=7, max_tokens=5, top_p=0.5, min_p=0.1),
        sampled(seed=None, max_tokens=24, temperature=1.5, presence_penalty=1.0),
    ]
    for position in (0, 2, 4):
        params = list(crowd)
        params.insert(position, target)
        prompts = list(PROMPTS)
        prompts.insert(position, PROMPTS[1])
        outs = llm.generate(prompts, params)
        assert tokens(outs[position]) == alone, f"seeded request at batch position {position}"


def test_different_seeds_give_different_outputs(llm):
    outs = llm.generate([PROMPTS[0]] * 4, [sampled(seed=s, max_tokens=16) for s in (1, 2, 3, 1)])
    seqs = [tuple(tokens(o)) for o in outs]
    assert seqs[0] == seqs[3]
    assert len({seqs[0], seqs[1], seqs[2]}) == 3


def test_unseeded_requests_vary(llm):
    outs = llm.generate([PROMPTS[0]] * 3, sampled(seed=None, max_tokens=16))
    assert len({tuple(tokens(o)) for o in outs}) > 1


def test_top_k_1_at_any_temperature_equals_greedy(llm):
    ref = llm.generate(PROMPTS, greedy(20))
    for temperature in (0.5, 1.0, 2.0):
        outs = llm.generate(PROMPTS, sampled(seed=None, max_tokens=20, temperature=temperature, top_k=1))
        assert [tokens(o) for o in outs] == [tokens(o) for o in ref]


# -- truncation stages restrict the support ------------------------------------------------------


def chosen_stats(out) -> list[tuple[int, float, float, float]]:
    """Per generated token: (rank, prob, top-1 prob, mass of strictly likelier tokens) under the raw model."""
    stats = []
    for token, entry in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
        chosen = entry[token]
        top1 = max(lp.logprob for lp in entry.values())
        before = sum(math.exp(lp.logprob) for lp in entry.values() if lp.logprob > chosen.logprob)
        stats.append((chosen.rank, math.exp(chosen.logprob), math.exp(top1), before))
    return stats


def sample_many(llm, **params) -> list[tuple[int, float, float, float]]:
    outs = llm.generate(PROMPTS * 2, [sampled(seed=i, max_tokens=24, logprobs=20, **params) for i in range(8)])
    return [s for o in outs for s in chosen_stats(o)]


@pytest.fixture(scope="module")
def unrestricted(llm):
    """Control: plain temperature-1 samples do pick unlikely tokens, so each check below can fail."""
    return sample_many(llm)


def test_top_k_samples_only_from_the_k_most_likely(llm, unrestricted):
    k = 3
    assert any(rank > k for rank, *_ in unrestricted)
    for rank, *_ in sample_many(llm, top_k=k):
        assert rank <= k


def test_top_p_samples_only_from_the_nucleus(llm, unrestricted):
    top_p = 0.6
    assert any(rank > 20 or before >= top_p for rank, _, _, before in unrestricted)
    for rank, _, _, before in sample_many(llm, top_p=top_p):
        assert rank <= 20 and before < top_p + 1e-6


def test_min_p_drops_tokens_below_the_threshold(llm, unrestricted):
    min_p = 0.2
    assert any(p < min_p * top1 for _, p, top1, _ in unrestricted)
    for _, p, top1, _ in sample_many(llm, min_p=min_p):
        assert p >= min_p * top1 * (1 - 1e-5)


ACTIVE = {
    "logit_bias": dict(logit_bias={3: 5.0}),
    "min_tokens": dict(min_tokens=8, max_tokens=10),
    "penalties": dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5),
    "temperature": dict(temperature=0.7),
    "top_k": dict(top_k=5),
    "top_p": dict(top_p=0.5),
    "min_p": dict(min_p=0.1),
}


@pytest.mark.parametrize("stage_name", list(ACTIVE))
def test_stages_leave_rows_that_did_not_ask_for_them_untouched(llm, stage_name):
    """A stage runs on the whole batch when any row needs it; the other rows must come out
    bit-identical, even for a very confident distribution (probabilities that round to 1)."""
    pipeline = llm.engine.sampler
    stage = pipeline.stages[pipeline.stage_names.index(stage_name)]
    vocab = 64
    torch.manual_seed(0)
    logits = torch.randn(3, vocab) * 3
    logits[1, 7] += 40.0  # the neutral row: one token holds essentially all the mass
    logits[2, 9] += 40.0
    history = [1, 3, 3, 5, 7, 2]
    seqs = [FakeSeq(SamplingParams(**ACTIVE[stage_name]), history),
            FakeSeq(SamplingParams(temperature=1.0), history),
            FakeSeq(SamplingParams(temperature=0.0), history)]
    batch = SamplingBatch(seqs, vocab, torch.device("cpu"), frozenset({2}))
    assert stage.is_active(seqs[0].params) and not stage.is_active(seqs[1].params)
    out = stage.apply(logits.clone(), batch)
    assert not torch.equal(out[0], logits[0]), "the active row should change"
    assert torch.equal(out[1], logits[1])
    assert torch.equal(out[2], logits[2])


# -- penalties -----------------------------------------------------------------------------------


def test_repetition_penalty_matches_transformers_processor(llm):
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    pipeline = llm.engine.sampler
    stage = pipeline.stages[pipeline.stage_names.index("penalties")]
    torch.manual_seed(1)
    vocab = 50
    logits = torch.randn(2, vocab) * 4
    histories = [[1, 4, 4, 9, 30, 2], [7, 7, 8, 49, 0]]
    seqs = [FakeSeq(SamplingParams(repetition_penalty=1.7), h, num_prompt_tokens=2) for h in histories]
    batch = SamplingBatch(seqs, vocab, torch.device("cpu"), frozenset())
    ours = stage.apply(logits.clone(), batch)
    hf = RepetitionPenaltyLogitsProcessor(1.7)
    for i, h in enumerate(histories):
        theirs = hf(torch.tensor([h]), logits[i:i + 1].clone())[0]
        torch.testing.assert_close(ours[i], theirs)


def test_greedy_with_repetition_penalty_matches_transformers_generate(llm, gqa_dir, hf_model, tokenizer):
    from transformers import GenerationConfig

    hf = hf_model(gqa_dir)
    prompt = PROMPTS[0]  # its plain greedy output repeats a token, which the penalty prevents
    ids = tokenizer(prompt).input_ids
    config = GenerationConfig(do_sample=False, max_new_tokens=24, repetition_penalty=1.5, pad_token_id=0)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), generation_config=config, attention_mask=torch.ones(1, len(ids)))
    ref_tokens = ref[0, len(ids):].tolist()
    plain, penalised = llm.generate([prompt, prompt], [greedy(24), greedy(24, repetition_penalty=1.5)])
    assert tokens(penalised) == ref_tokens
    assert tokens(plain) != ref_tokens, "the penalty should change this output"


def reference_penalised_greedy(hf, ids: list[int], steps: int, frequency: float, presence: float) -> list[int]:
    """OpenAI's definition on transformers' logits: logit - frequency * count - presence * [count > 0]."""
    out: list[int] = []
    with torch.no_grad():
        for _ in range(steps):
            logits = hf(torch.tensor([ids + out])).logits[0, -1].float()
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.numel()).float()
            logits = logits - frequency * counts - presence * (counts > 0).float()
            out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize("frequency,presence", [(1.0, 0.0), (0.0, 1.5), (0.4, 0.4)])
def test_frequency_and_presence_penalties(llm, gqa_dir, hf_model, tokenizer, frequency, presence):
    hf = hf_model(gqa_dir)
    prompt = PROMPTS[0]
    ids = tokenizer(prompt).input_ids
    want = reference_penalised_greedy(hf, ids, 24, frequency, presence)
    plain, got = llm.generate([prompt, prompt], [
        greedy(24), greedy(24, frequency_penalty=frequency, presence_penalty=presence)])
    assert tokens(got) == want
    assert tokens(plain) != want


def test_negative_presence_penalty_encourages_repeats(llm):
    plain, repeat = llm.generate([PROMPTS[2]] * 2, [greedy(24), greedy(24, presence_penalty=-2.0,
                                                                       frequency_penalty=-2.0)])
    assert len(set(tokens(repeat))) < len(set(tokens(plain)))


# -- logit bias ----------------------------------------------------------------------------------


def test_logit_bias_forces_and_bans_tokens(llm):
    forced_token = 300
    outs = llm.generate(PROMPTS[:2], [greedy(8, logit_bias={forced_token: 100}),
                                      sampled(seed=3, max_tokens=8, logit_bias={forced_token: 100})])
    for out in outs:
        assert tokens(out) == [forced_token] * 8
    first = tokens(llm.generate(PROMPTS[0], greedy(1))[0])[0]
    banned = tokens(llm.generate(PROMPTS[0], greedy(8, logit_bias={first: -100}))[0])
    assert banned[0] != first


# -- stop conditions -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference_text(llm):
    """A greedy continuation whose text serves to pick stop strings."""
    out = llm.generate(PROMPTS[1], greedy(24))[0].outputs[0]
    assert len(out.text) > 20
    return out


def test_max_tokens_finishes_with_length(llm):
    out = llm.generate(PROMPTS[0], greedy(5))[0].outputs[0]
    assert len(out.token_ids) == 5
    assert (out.finish_reason, out.stop_reason) == ("length", None)


def test_stop_string_truncates_the_text(llm, reference_text):
    text = reference_text.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    cut = text.index(stop)
    out = llm.generate(PROMPTS[1], greedy(24, stop=[stop, "never appears \x00"]))[0].outputs[0]
    assert out.text == text[:cut]
    assert stop not in out.text
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert reference_text.token_ids[:len(out.token_ids)] == out.token_ids
    assert len(out.token_ids) < len(reference_text.token_ids)

    kept = llm.generate(PROMPTS[1], greedy(24, stop=stop, include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == text[:cut + len(stop)]
    assert kept.token_ids == out.token_ids
    assert (kept.finish_reason, kept.stop_reason) == ("stop", stop)


def test_earliest_of_several_stop_strings_wins(llm, reference_text):
    text = reference_text.text
    early, late = text[4:7], text[-4:-1]
    out = llm.generate(PROMPTS[1], greedy(24, stop=[late, early]))[0].outputs[0]
    cut = min(text.index(early), text.index(late))
    assert out.text == text[:cut]


def test_stop_token_ids_end_with_stop_and_the_id(llm, reference_text):
    ids = reference_text.token_ids
    k = 6
    stop_id = ids[k]
    first = ids.index(stop_id)
    out = llm.generate(PROMPTS[1], greedy(24, stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == ids[:first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)


def test_eos_stops_unless_ignored(llm):
    bias = {EOS: 100}
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8, logit_bias=bias))[0].outputs[0]
    assert out.token_ids == [EOS]
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
    ignored = llm.generate(PROMPTS[0], greedy(8, logit_bias=bias))[0].outputs[0]
    assert ignored.token_ids == [EOS] * 8 and ignored.finish_reason == "length"


def test_min_tokens_holds_back_eos_and_stop_tokens(llm):
    bias = {EOS: 100}
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, min_tokens=5,
                                                  logit_bias=bias))[0].outputs[0]
    assert len(out.token_ids) == 6 and out.token_ids[-1] == EOS and EOS not in out.token_ids[:5]
    assert out.finish_reason == "stop"

    stop_id = 300
    out = llm.generate(PROMPTS[0], greedy(12, min_tokens=4, stop_token_ids=[stop_id],
                                          logit_bias={stop_id: 100}))[0].outputs[0]
    assert out.token_ids[-1] == stop_id and len(out.token_ids) == 5 and stop_id not in out.token_ids[:4]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)


def test_min_tokens_ignores_stop_strings_completed_before_it(llm, reference_text):
    """A stop string completed within the first min_tokens tokens neither ends the output nor
    cuts it: the text stays whole."""
    text, ids = reference_text.text, reference_text.token_ids
    early = llm.generate(PROMPTS[1], greedy(3))[0].outputs[0].text
    stop = next(early[i:i + 2] for i in range(len(early) - 1)
                if text.count(early[i:i + 2]) == 1 and early[i:i + 2].strip())
    # A long second stop string widens the window the detokenizer searches; the early match must
    # still not be found once min_tokens is reached.
    stops = [stop, "a stop string much longer than the other"]
    out = llm.generate(PROMPTS[1], greedy(24, min_tokens=10, stop=stops))[0].outputs[0]
    assert out.token_ids == ids
    assert out.text == text
    assert out.finish_reason == "length"


# -- n and logprobs ------------------------------------------------------------------------------


def test_n_returns_indexed_independent_samples(llm):
    out = llm.generate(PROMPTS[0], sampled(seed=5, max_tokens=12, n=2))[0]
    assert [c.index for c in out.outputs] == [0, 1]
    assert out.outputs[0].token_ids != out.outputs[1].token_ids
    again = llm.generate(PROMPTS[0], sampled(seed=5, max_tokens=12, n=2))[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]

    both = llm.generate(PROMPTS[0], greedy(12, n=3))[0]
    assert [c.index for c in both.outputs] == [0, 1, 2]
    assert all(c.token_ids == both.outputs[0].token_ids for c in both.outputs)
    assert all(c.finish_reason == "length" for c in both.outputs)


def test_logprobs_hold_the_chosen_token_and_top_n(llm, tokenizer):
    n = 4
    out = llm.generate(PROMPTS[2], sampled(seed=9, max_tokens=16, logprobs=n))[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == 16
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry
        alternatives = sorted((lp for tid, lp in entry.items() if lp.rank <= n), key=lambda lp: lp.rank)
        assert [lp.rank for lp in alternatives] == list(range(1, n + 1))
        assert all(a.logprob >= b.logprob for a, b in zip(alternatives, alternatives[1:]))
        assert len(entry) == n + (entry[token].rank > n)
        chosen = entry[token]
        assert chosen.rank == 1 + sum(lp.logprob > chosen.logprob for lp in alternatives) or chosen.rank > n
        assert sum(math.exp(lp.logprob) for lp in alternatives) <= 1 + 1e-5
        for tid, lp in entry.items():
            assert lp.decoded_token == tokenizer.decode([tid])
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))

    only_chosen = llm.generate(PROMPTS[2], greedy(4, logprobs=0))[0].outputs[0]
    assert all(list(e) == [t] and e[t].rank == 1 for t, e in zip(only_chosen.token_ids, only_chosen.logprobs))
    assert llm.generate(PROMPTS[2], greedy(4))[0].outputs[0].logprobs is None


# -- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [
    dict(logit_bias={600: 5.0}), dict(logit_bias={-1: 5.0}),
    dict(stop_token_ids=[600], min_tokens=2), dict(stop_token_ids=[3, 10_000]),
])
def test_token_ids_in_params_must_be_in_the_vocabulary(llm, bad):
    with pytest.raises(InvalidRequestError) as err:
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=4, **bad))
    assert err.value.param == next(iter(bad))
    assert "511" in str(err.value)
    assert not llm.engine.has_unfinished_requests()
    assert len(tokens(llm.generate(PROMPTS[0], greedy(3))[0])) == 3


@pytest.mark.parametrize("bad", [
    dict(top_p=0.0), dict(top_p=1.5), dict(n=0), dict(temperature=-0.5), dict(max_tokens=-1),
    dict(min_tokens=5, max_tokens=2), dict(min_p=1.5), dict(repetition_penalty=0.0),
    dict(frequency_penalty=3.0), dict(presence_penalty=-2.5), dict(logprobs=21), dict(prompt_logprobs=-1),
    dict(stop=[""]), dict(logit_bias={5: 500}), dict(repetition_penalty=float("inf")),
    dict(temperature=float("nan")), dict(top_p=float("nan")),
])
def test_bad_sampling_params_are_rejected(bad):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**bad)
    param = next(iter(bad))
    assert err.value.param == param
    assert param in str(err.value)
