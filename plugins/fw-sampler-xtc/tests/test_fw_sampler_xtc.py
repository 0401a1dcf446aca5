"""XTC on crafted logits: every token at least `threshold` probable is removed except the least
probable of them, so greedy picks exactly the expected token; nothing happens with fewer than two
such tokens, a threshold above 0.5 or probability 0; the per-step draw comes from the row's seeded
generator, so a seeded request picks the same tokens alone and in any batch."""

from __future__ import annotations

import re

import pytest
import torch

from xtc_testing import FakeSeq, logits_for, sampler_pipeline, step, xtc  # first: the plugin from the checkout
from fw import SamplingParams
from fw.errors import InvalidRequestError
from fw.sampling.batch import SamplingBatch
from fw_sampler_xtc.plugin import Xtc

PROBS = [0.05, 0.5, 0.15, 0.3]  # token 1 most likely, then 3, 2, 0


@pytest.fixture(scope="module")
def pipeline():
    return sampler_pipeline()


def greedy(samplers=None, **extra) -> SamplingParams:
    return SamplingParams(temperature=0, samplers=samplers, **extra)


def test_removes_the_top_choices_but_the_least_probable(pipeline):
    seqs = [FakeSeq(greedy(xtc(0.1, 1.0))),  # 0.5, 0.3, 0.15 reach 0.1: only 0.15 (token 2) stays
            FakeSeq(greedy(xtc(0.2, 1.0))),  # 0.5, 0.3 reach it: token 3 stays
            FakeSeq(greedy(xtc(0.4, 1.0))),  # one token reaches it: nothing removed
            FakeSeq(greedy(xtc(0.6, 1.0))),  # above 0.5: off
            FakeSeq(greedy(xtc(0.1, 0.0))),  # never fires
            FakeSeq(greedy())]  # no XTC in the same batch
    logits = logits_for(PROBS).repeat(len(seqs), 1)
    assert step(pipeline, seqs, logits) == [2, 3, 1, 1, 1, 1]


def test_exact_logits():
    stage = Xtc()
    params = stage.prepare({"threshold": 0.1, "probability": 1.0}, None)
    logits = logits_for(PROBS).unsqueeze(0)
    batch = SamplingBatch([FakeSeq(greedy())], len(PROBS), torch.device("cpu"), frozenset())
    out = stage.apply(logits.clone(), batch, [params])
    expected = logits.clone()
    expected[0, [1, 3]] = float("-inf")
    assert torch.equal(out, expected)


def test_ties_with_the_least_probable_stay(pipeline):
    seqs = [FakeSeq(greedy(xtc(0.3, 1.0))), FakeSeq(greedy(xtc(0.2, 1.0)))]
    logits = logits_for([0.4, 0.4, 0.2]).repeat(2, 1)
    assert step(pipeline, seqs, logits) == [0, 2]  # a tie at the least probable removes nothing


def test_sampling_never_picks_a_removed_token(pipeline):
    logits = logits_for(PROBS).repeat(64, 1)
    with_xtc = step(pipeline, [FakeSeq(SamplingParams(seed=s, samplers=xtc(0.1, 1.0))) for s in range(64)], logits)
    without = step(pipeline, [FakeSeq(SamplingParams(seed=s)) for s in range(64)], logits)
    assert set(with_xtc) == {0, 2}
    assert {1, 3} <= set(without)


def run_steps(pipeline, target: FakeSeq, others: list[FakeSeq], steps: int) -> list[int]:
    """`target`'s token at each step, sampled in a batch with `others` (target in the middle)."""
    picks = []
    logits = logits_for(PROBS)
    for _ in range(steps):
        seqs = others[: len(others) // 2] + [target] + others[len(others) // 2:]
        picks.append(step(pipeline, seqs, logits.repeat(len(seqs), 1))[seqs.index(target)])
    return picks


def test_the_draw_comes_from_the_rows_seeded_generator(pipeline):
    steps = 40
    twin = torch.Generator().manual_seed(11)
    expected = [2 if float(torch.rand((), generator=twin)) < 0.5 else 1 for _ in range(steps)]
    assert set(expected) == {1, 2}
    alone = run_steps(pipeline, FakeSeq(greedy(xtc(0.1, 0.5), seed=11)), [], steps)
    assert alone == expected
    crowd = [FakeSeq(SamplingParams(samplers=xtc(0.1, 0.5))), FakeSeq(greedy()),
             FakeSeq(SamplingParams(seed=3, samplers=xtc(0.2, 0.7))), FakeSeq(SamplingParams(temperature=0.8))]
    assert run_steps(pipeline, FakeSeq(greedy(xtc(0.1, 0.5), seed=11)), crowd, steps) == expected


def test_seeded_sampling_is_the_same_alone_and_batched(pipeline):
    def target():
        return FakeSeq(SamplingParams(seed=5, samplers=xtc(0.1, 0.5)))

    alone = run_steps(pipeline, target(), [], 30)
    crowd = [FakeSeq(SamplingParams(samplers=xtc(0.1, 0.9))), FakeSeq(SamplingParams(seed=8)), FakeSeq(greedy())]
    assert run_steps(pipeline, target(), crowd, 30) == alone
    assert len(set(alone)) > 1


def test_defaults_and_parameter_errors(pipeline):
    stage = pipeline.per_request["xtc"][1]
    params = greedy([{"name": "xtc"}])
    pipeline.validate(params)
    prepared = params.samplers[0].prepared[id(stage)]
    assert (prepared.threshold, prepared.probability) == (0.1, 0.5)
    for args, message in [
        (dict(threshold=1.5), "samplers: xtc: threshold: 1.5 is greater than the maximum of 1"),
        (dict(probability=-0.1), "samplers: xtc: probability: -0.1 is less than the minimum of 0"),
        (dict(probability="high"), "samplers: xtc: probability: 'high' is not of type 'number'"),
        (dict(treshold=0.1), "samplers: xtc: Additional properties are not allowed ('treshold' was unexpected)"),
        (dict(threshold=float("nan")), "samplers: xtc: threshold must be a finite number, got nan"),
    ]:
        with pytest.raises(InvalidRequestError, match="^" + re.escape(message) + "$"):
            pipeline.validate(greedy([{"name": "xtc", **args}]))
