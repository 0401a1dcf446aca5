"""Per-request samplers in the core: `SamplingParams.samplers` and `allowed_token_ids`, the
`SamplerSpec` schema and per_request flag, the pipeline running a per-request stage on just the
rows that name it (with each row's parameters, prepared once per request), the 400s for unknown
names and bad parameters; then DRY and XTC through the library, batched with plain requests."""

from __future__ import annotations

import dataclasses
import importlib.metadata as md

import pytest
import torch

from conftest import make_llm
from fw import SamplingParams
from fw.errors import InvalidRequestError
from fw.plugins import SamplerSpec
from fw.sampling.batch import SamplingBatch
from fw.sampling.params import SamplerRequest
from fw.sampling.pipeline import SamplerPipeline
from fw.testing import FakeSequence
from sampler_plugins import manager_with_sampler_plugins, repeated_trigrams

VOCAB = 16


def batch_of(params: list[SamplingParams]) -> SamplingBatch:
    return SamplingBatch([FakeSequence(p, [1, 2, 3]) for p in params], VOCAB, torch.device("cpu"), frozenset())


# -- SamplingParams ----------------------------------------------------------------------------


def test_samplers_are_normalised_to_requests():
    given = {"name": "dry", "multiplier": 0.8}
    p = SamplingParams(samplers=[given, "xtc", SamplerRequest("other", {"k": 1})])
    assert p.samplers == [SamplerRequest("dry", {"multiplier": 0.8}), SamplerRequest("xtc"),
                          SamplerRequest("other", {"k": 1})]
    assert given == {"name": "dry", "multiplier": 0.8}  # the caller's dict is not consumed
    assert p.sampler("xtc") is p.samplers[1] and p.sampler("top_k") is None
    assert SamplingParams().samplers == []
    # the engine copies params (dataclasses.replace): the requests, and what was prepared, carry over
    p.samplers[0].prepared[1] = "ready"
    assert dataclasses.replace(p, max_tokens=3).samplers[0].prepared == {1: "ready"}


@pytest.mark.parametrize("samplers, message", [
    ("dry", 'samplers must be a list such as [{"name": "dry", "multiplier": 0.8}], got str'),
    ({"name": "dry"}, "samplers must be a list"),
    ([{"multiplier": 1.0}], 'samplers[0] needs a "name" (a string naming the sampler), got None'),
    ([{"name": 3}], 'samplers[0] needs a "name"'),
    ([3], 'samplers[0] must be an object with a "name" or a sampler name, got int'),
    ([""], "samplers[0]: the sampler name is empty"),
    (["dry", {"name": "dry", "base": 2.0}], "samplers: 'dry' is named twice"),
])
def test_malformed_samplers_are_refused(samplers, message):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(samplers=samplers)
    assert message in str(info.value) and info.value.param == "samplers"


@pytest.mark.parametrize("ids, message", [
    ([], "allowed_token_ids is empty, which would allow no token"),
    ("abc", "allowed_token_ids must be a list of token ids (integers), got 'abc'"),
    ([1, 2.5], "allowed_token_ids must be a list of token ids"),
    ([True], "allowed_token_ids must be a list of token ids"),
])
def test_malformed_allowed_token_ids_are_refused(ids, message):
    with pytest.raises(InvalidRequestError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        SamplingParams(allowed_token_ids=ids)


# -- SamplerSpec ------------------------------------------------------------------------------


SHIFT_SCHEMA = {
    "type": "object",
    "properties": {"token": {"type": "integer", "minimum": 0}, "amount": {"type": "number", "default": 10.0}},
    "required": ["token"],
    "additionalProperties": False,
}


def test_sampler_spec_checks_its_schema_and_role():
    spec = SamplerSpec("shift", object, per_request=True, parameters=SHIFT_SCHEMA)
    assert spec.summary() == {"role": "stage", "order": 100, "per_request": True, "parameters": SHIFT_SCHEMA}
    assert SamplerSpec("plain", object).summary() == {"role": "stage", "order": 100}
    with pytest.raises(ValueError, match="only stages can be per_request"):
        SamplerSpec("c", object, role="choice", per_request=True)
    with pytest.raises(ValueError, match="a parameters schema needs per_request=True"):
        SamplerSpec("s", object, parameters=SHIFT_SCHEMA)
    with pytest.raises(ValueError, match='parameters must be a JSON schema with "type": "object"'):
        SamplerSpec("s", object, per_request=True, parameters={"type": "array"})
    with pytest.raises(ValueError, match="sampler 's': parameters is not a valid JSON schema: 'nope' is not valid"):
        SamplerSpec("s", object, per_request=True, parameters={"type": "object", "properties": {"x": {"type": "nope"}}})


# -- the pipeline's per-request dispatch ----------------------------------------------------------


class Shift:
    """A per-request stage: adds `amount` to token `token`'s logit; records what it was given."""

    def __init__(self):
        self.calls: list[tuple[torch.Tensor, int, list]] = []
        self.prepared: list[tuple[dict, object]] = []

    def prepare(self, args: dict, tokenizer) -> dict:
        if args["token"] >= VOCAB:
            raise ValueError(f"token {args['token']} is outside the vocabulary")
        self.prepared.append((args, tokenizer))
        return dict(args, ready=True)

    def apply(self, logits: torch.Tensor, batch: SamplingBatch, args: list[dict]) -> torch.Tensor:
        self.calls.append((logits.clone(), len(batch), args))
        for row, a in enumerate(args):
            logits[row, a["token"]] += a["amount"]
        return logits


class Marker:
    """A per-request stage without parameters."""

    def apply(self, logits, batch, args):
        return logits


def toy_pipeline() -> tuple[SamplerPipeline, Shift]:
    from fw.plugins.manager import PluginManager

    eps = [ep for ep in md.distribution("fw").entry_points if ep.group == "fw" and ep.name == "samplers"]
    registry = PluginManager(entry_points=eps, allow={"samplers"}, block=()).load().registry("sampler")
    registry.add(SamplerSpec("shift", Shift, order=45, per_request=True, parameters=SHIFT_SCHEMA), "toy", "tests")
    registry.add(SamplerSpec("marker", Marker, order=46, per_request=True), "toy", "tests")
    pipeline = SamplerPipeline(registry, "default")
    return pipeline, pipeline.per_request["shift"][1]


def test_only_rows_naming_a_stage_run_it_each_with_its_parameters():
    pipeline, shift = toy_pipeline()
    params = [SamplingParams(temperature=0, samplers=[{"name": "shift", "token": 5}]),
              SamplingParams(temperature=0),
              SamplingParams(temperature=0, samplers=[{"name": "shift", "token": 9, "amount": 20.0}]),
              SamplingParams(temperature=0, samplers=["marker"])]
    for p in params:
        pipeline.validate(p, tokenizer="the tokenizer")
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB)
    seen = {}
    choose = pipeline.chooser.choose

    def record(final: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        seen["logits"] = final.clone()
        return choose(final, batch)

    pipeline.chooser.choose = record
    tokens = pipeline.sample(logits.clone(), batch_of(params)).token_ids
    assert tokens == [5, int(logits[1].argmax()), 9, int(logits[3].argmax())]
    (given, rows, args), = shift.calls
    assert rows == 2 and torch.equal(given, logits[[0, 2]])  # just its rows
    assert args == [{"token": 5, "amount": 10.0, "ready": True}, {"token": 9, "amount": 20.0, "ready": True}]
    assert shift.prepared == [({"token": 5, "amount": 10.0}, "the tokenizer"),
                              ({"token": 9, "amount": 20.0}, "the tokenizer")]
    assert torch.equal(seen["logits"][[1, 3]], logits[[1, 3]])  # the others are bit-identical
    expected = logits[[0, 2]].clone()
    expected[0, 5] += 10.0
    expected[1, 9] += 20.0
    assert torch.equal(seen["logits"][[0, 2]], expected)


def test_parameters_are_prepared_once_per_request():
    pipeline, shift = toy_pipeline()
    p = SamplingParams(temperature=0, samplers=[{"name": "shift", "token": 3}])
    pipeline.validate(p, tokenizer="tok")
    for _ in range(3):
        pipeline.sample(torch.zeros(2, VOCAB), batch_of([p, p]))
    assert len(shift.prepared) == 1 and len(shift.calls) == 3
    assert shift.calls[0][1] == 2  # every row names it: the whole batch, no copy
    # params that never went through validate (a direct caller) are prepared on first use, once
    q = SamplingParams(temperature=0, samplers=[{"name": "shift", "token": 4}])
    for _ in range(2):
        assert pipeline.sample(torch.zeros(1, VOCAB), batch_of([q])).token_ids == [4]
    assert [t for t, _ in shift.prepared] == [{"token": 3, "amount": 10.0}, {"token": 4, "amount": 10.0}]


def test_a_stage_runs_in_its_place_in_the_order():
    """Order 45 comes after temperature (40): the stage sees the tempered logits."""
    pipeline, shift = toy_pipeline()
    p = SamplingParams(temperature=0.5, seed=1, samplers=[{"name": "shift", "token": 3}])
    pipeline.validate(p)
    logits = torch.randn(1, VOCAB)
    pipeline.sample(logits.clone(), batch_of([p]))
    torch.testing.assert_close(shift.calls[0][0], logits / 0.5)


@pytest.mark.parametrize("samplers, message", [
    ([{"name": "nope"}], "samplers[0]: no per-request sampler named 'nope'; available: marker, shift"),
    (["marker", {"name": "top_k"}], "samplers[1]: 'top_k' is a built-in stage set by its own request fields, "
                                    "not a per-request sampler; per-request samplers here: marker, shift"),
    ([{"name": "shift"}], "samplers: shift: 'token' is a required property"),
    ([{"name": "shift", "token": -1}], "samplers: shift: token: -1 is less than the minimum of 0"),
    ([{"name": "shift", "token": 1, "amount": "lots"}], "samplers: shift: amount: 'lots' is not of type 'number'"),
    ([{"name": "shift", "token": 1, "extra": 1}],
     "samplers: shift: Additional properties are not allowed ('extra' was unexpected)"),
    ([{"name": "shift", "token": 99}], "samplers: shift: token 99 is outside the vocabulary"),  # from prepare
    ([{"name": "marker", "x": 1}], "samplers: marker takes no parameters, got x"),
])
def test_unknown_samplers_and_bad_parameters_are_request_errors(samplers, message):
    pipeline, _ = toy_pipeline()
    with pytest.raises(InvalidRequestError) as info:
        pipeline.validate(SamplingParams(samplers=samplers))
    assert str(info.value) == message and info.value.param == "samplers" and info.value.status_code == 400


# -- allowed_token_ids ------------------------------------------------------------------------


def test_allowed_token_ids_stage():
    pipeline, _ = toy_pipeline()
    stage = pipeline.stages[pipeline.stage_names.index("allowed_token_ids")]
    params = [SamplingParams(temperature=0, allowed_token_ids=[2, 7, 11]), SamplingParams(temperature=0)]
    torch.manual_seed(0)
    logits = torch.randn(2, VOCAB)
    logits[0, 4] = 50.0  # the favourite, not allowed
    assert stage.is_active(params[0]) and not stage.is_active(params[1])
    out = stage.apply(logits.clone(), batch_of(params))
    assert torch.equal(out[1], logits[1])
    assert torch.isneginf(out[0]).tolist() == [t not in (2, 7, 11) for t in range(VOCAB)]
    assert torch.equal(out[0, [2, 7, 11]], logits[0, [2, 7, 11]])
    tokens = pipeline.sample(logits.clone(), batch_of(params)).token_ids
    assert tokens == [[2, 7, 11][int(logits[0, [2, 7, 11]].argmax())], int(logits[1].argmax())]


def test_allowed_token_ids_in_the_engine(llm):
    prompts = ["Hello world", "Once upon a time"]
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain)]
    allowed = [40, 41, 42, 300]
    restricted = dataclasses.replace(plain, allowed_token_ids=allowed, logit_bias={7: 100.0})
    outs = llm.generate(prompts * 2, [restricted, plain, plain, restricted])
    assert set(outs[0].outputs[0].token_ids) <= set(allowed) and set(outs[3].outputs[0].token_ids) <= set(allowed)
    assert [outs[1].outputs[0].token_ids, outs[2].outputs[0].token_ids] == [alone[1], alone[0]]
    with pytest.raises(InvalidRequestError, match=r"allowed_token_ids: token id 512 is outside the vocabulary "
                                                  r"\(0\.\.511\)"):
        llm.generate("hi", dataclasses.replace(plain, allowed_token_ids=[3, 512]))


# -- DRY and XTC through the library ------------------------------------------------------------


@pytest.fixture(scope="module")
def plugin_llm(gqa_dir):
    return make_llm(gqa_dir, plugins=manager_with_sampler_plugins())


REPEATING = "The engine schedules every request"  # its plain greedy output repeats a 3-token window
DRY = {"name": "dry", "multiplier": 100.0, "sequence_breakers": []}
LEAST_LIKELY = {"name": "xtc", "threshold": 0.0, "probability": 1.0}  # every token is a top choice


def test_dry_and_xtc_batched_with_plain_requests(plugin_llm):
    def params(**kw):
        return SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=0, **kw)

    prompts = [REPEATING, "Hello world", REPEATING, "Once upon a time", REPEATING]
    alone = [o.outputs[0] for o in plugin_llm.generate(prompts[:2], params())]
    assert repeated_trigrams(alone[0].token_ids) > 0
    batch = [params(samplers=[DRY]), params(), params(samplers=[LEAST_LIKELY]), params(),
             params(samplers=[DRY, LEAST_LIKELY])]
    outs = [o.outputs[0] for o in plugin_llm.generate(prompts, batch)]
    assert outs[1].token_ids == alone[1].token_ids
    assert outs[0].token_ids != alone[0].token_ids and repeated_trigrams(outs[0].token_ids) == 0
    vocab = plugin_llm.engine.vocab_size
    # XTC with threshold 0 leaves only the least likely token: the last rank of the model's distribution
    assert all(lp[t].rank == vocab for t, lp in zip(outs[2].token_ids, outs[2].logprobs))
    assert len(outs[4].token_ids) == 48  # a request may name both
    alone_dry = plugin_llm.generate(REPEATING, batch[0])[0].outputs[0]
    assert alone_dry.token_ids == outs[0].token_ids


def test_library_refuses_bad_sampler_parameters(plugin_llm):
    with pytest.raises(InvalidRequestError, match=r"^samplers: dry: base: 0 is less than the minimum of 1$"):
        plugin_llm.generate("hi", SamplingParams(samplers=[{"name": "dry", "base": 0}]))
    with pytest.raises(InvalidRequestError, match=r"no per-request sampler named 'dyr'; available: dry, xtc"):
        plugin_llm.generate("hi", SamplingParams(samplers=["dyr"]))
    assert not plugin_llm.engine.has_unfinished_requests()
