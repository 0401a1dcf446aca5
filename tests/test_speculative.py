"""Speculative decoding (fw.speculative, docs/speculative.md): the `proposer` plugin kind and the built-in
`ngram` proposer, `--speculative-config`, the rejection rule against exact probabilities, and the engine's
verify step on the tiny models: greedy and seeded outputs identical to decoding without it (batching,
chunked prefill, preemption, stop rules, grammar, logprobs), KV pages given back, counters."""

from __future__ import annotations

import importlib.metadata as md
import math

import numpy as np
import pytest
import torch

from conftest import make_llm
from fw import SamplingParams
from fw.config import resolve_config
from fw.errors import ConfigError, InvalidRequestError, UnknownImplementationError
from fw.plugins import ProposerSpec
from fw.plugins.manager import PluginManager
from fw.speculative import Draft
from fw.speculative.config import SpeculativeConfig
from fw.speculative.rejection import accepted_prefix, residual, verify
from fw.speculative.service import Speculator

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPTS = [
    "Hello world",
    "one two three one two three one two three one two",
    "The engine schedules every request in pages",
    "a plugin registers samplers, a plugin registers samplers, a plugin",
]


def greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def token_ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


# -- test proposers: they know the reference output, so how much is accepted is up to the test -------------------


class ReplayProposer:
    """Proposes the reference continuation of each prompt (recorded without speculation), with every token at
    draft position `wrong_at` replaced by another: all accepted, or up to that position."""

    def __init__(self, references: dict[tuple[int, ...], list[int]], wrong_at: int | None, vocab: int,
                 with_probs: bool = False):
        self.references, self.wrong_at, self.vocab, self.with_probs = references, wrong_at, vocab, with_probs
        self.released: list[int] = []

    def propose(self, requests):
        out = []
        for r in requests:
            ref = self.references.get(tuple(r.token_ids[:r.num_prompt_tokens]))
            done = len(r.token_ids) - r.num_prompt_tokens
            if ref is None or done >= len(ref):
                out.append(None)
                continue
            ids = list(ref[done:done + r.max_tokens])
            if self.wrong_at is not None and self.wrong_at < len(ids):
                ids[self.wrong_at] = (ids[self.wrong_at] + 1) % self.vocab
            probs = None
            if self.with_probs:  # as if drawn from a flat distribution with a bump on the proposed token
                probs = torch.full((len(ids), self.vocab), 0.5 / (self.vocab - 1))
                probs[torch.arange(len(ids)), torch.tensor(ids)] = 0.5
            out.append(Draft(ids, probs))
        return out

    def release(self, seq_id: int) -> None:
        self.released.append(seq_id)


def manager_with(name: str, proposer) -> PluginManager:
    """fw's built-in plugins plus a test proposer registered as `name`."""
    eps = [ep for ep in md.distribution("fw").entry_points if ep.group == "fw"]
    pm = PluginManager(entry_points=eps, allow={ep.name for ep in eps}, block=()).load()
    pm.registry("proposer").add(ProposerSpec(name, lambda args, ctx: proposer), "test", "tests")
    return pm


@pytest.fixture(scope="module")
def base(gqa_dir):
    """The reference engine: no speculation."""
    return make_llm(gqa_dir)


@pytest.fixture(scope="module")
def references(base):
    """Greedy outputs of PROMPTS without speculation, keyed by prompt token ids."""
    outs = base.generate(PROMPTS, greedy(40))
    return {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in outs}


def replay_llm(gqa_dir, references, wrong_at=None, with_probs=False, k=4, **options):
    proposer = ReplayProposer(references, wrong_at, 512, with_probs)
    llm = make_llm(gqa_dir, plugins=manager_with("replay", proposer),
                   speculative_config={"method": "replay", "num_speculative_tokens": k, **options.pop("spec", {})},
                   **options)
    assert llm.engine.vocab_size == 512
    llm.proposer = proposer
    return llm


# -- the plugin kind and the ngram proposer ------------------------------------------------------------------------


def test_ngram_is_a_registered_proposer_plugin():
    pm = PluginManager().load()
    assert "ngram" in pm.registry("proposer").names()
    assert pm.plugins["ngram"].provides == {"proposer": ["ngram"]}
    assert pm.plugins["ngram"].module == "fw.backends.speculative.ngram"


def test_ngram_lookup_takes_the_longest_then_latest_match():
    pm = PluginManager().load()
    spec = pm.registry("proposer").get("ngram")
    proposer = spec.factory({"prompt_lookup_min": 1, "prompt_lookup_max": 3}, None)

    def draft(tokens, k=4):
        from fw.speculative import DraftRequest

        (d,) = proposer.propose([DraftRequest(0, tokens, 1, k, None)])
        return None if d is None else d.token_ids

    assert draft([1, 2, 3, 4, 5, 1, 2, 3]) == [4, 5, 1, 2]  # "1 2 3" seen before: what followed it
    assert draft([1, 2, 3, 4, 5, 1, 2, 3], k=2) == [4, 5]
    assert draft([7, 1, 9, 3, 1, 9, 8, 2, 9]) == [8, 2, 9]  # only "9" matches: its latest occurrence
    assert draft([5, 6, 7, 8]) is None
    assert draft([5]) is None
    strict = spec.factory({"prompt_lookup_min": 3, "prompt_lookup_max": 3}, None)
    from fw.speculative import DraftRequest

    assert strict.propose([DraftRequest(0, [7, 1, 9, 3, 1, 9, 8, 2, 9], 1, 4, None)]) == [None]


def test_ngram_defaults_follow_vllm():
    from fw.plugins.manager import PluginManager as PM

    build = PM().load().registry("proposer").get("ngram").factory
    p = build({}, None)
    assert (p.n_min, p.n_max) == (2, 5)
    p = build({"prompt_lookup_max": 4}, None)
    assert (p.n_min, p.n_max) == (4, 4)
    p = build({"prompt_lookup_min": 3}, None)
    assert (p.n_min, p.n_max) == (3, 3)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        build({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, None)


# -- --speculative-config ------------------------------------------------------------------------------------------


def test_config_is_read_from_the_flag_env_yaml_and_library(tmp_path):
    text = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    assert resolve_config(cli={"speculative_config": text}, environ={}).speculative_config == {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    assert resolve_config(environ={"FW_SPECULATIVE_CONFIG": text}).speculative_config["num_speculative_tokens"] == 3
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("speculative-config:\n  method: ngram\n  num_speculative_tokens: 2\n")
    assert resolve_config(config_file=str(yaml_file), environ={}).speculative_config == {
        "method": "ngram", "num_speculative_tokens": 2}
    assert resolve_config(environ={}, speculative_config={"method": "ngram"}).speculative_config == {"method": "ngram"}
    parsed = SpeculativeConfig.parse(text)
    assert (parsed.method, parsed.num_speculative_tokens, parsed.args) == ("ngram", 3, {"prompt_lookup_max": 4})
    assert SpeculativeConfig.parse(None) is None


@pytest.mark.parametrize("value, message", [
    ("{not json", "JSON object"),
    ("[1, 2]", "JSON object"),
    ('{"num_speculative_tokens": 4}', '"method" is required'),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "from 1 to 16"),
    ('{"method": "ngram", "num_speculative_tokens": 17}', "from 1 to 16"),
    ('{"method": "ngram", "disable_by_batch_size": 0}', "disable_by_batch_size"),
    ('{"method": "ngram", "min_acceptance_rate": 2}', "min_acceptance_rate"),
    ('{"method": "ngram", "adaptive_k": "yes"}', "adaptive_k must be true or false"),
])
def test_bad_configurations_are_config_errors_naming_the_flag(value, message):
    with pytest.raises(ConfigError, match=message) as info:
        resolve_config(cli={"speculative_config": value}, environ={})
    assert "--speculative-config" in str(info.value)


def test_unknown_method_and_options_are_refused_before_the_model_loads():
    registry = PluginManager().load().registry("proposer")
    with pytest.raises(UnknownImplementationError,
                       match="--speculative-config: method 'eagle'.*registered: draft_model, ngram"):
        Speculator(SpeculativeConfig.parse({"method": "eagle"}), registry)
    with pytest.raises(ConfigError, match="ngram.*'model' was unexpected"):
        Speculator(SpeculativeConfig.parse({"method": "ngram", "model": "x"}), registry)
    with pytest.raises(ConfigError, match="prompt_lookup_min.*minimum of 1"):
        Speculator(SpeculativeConfig.parse({"method": "ngram", "prompt_lookup_min": 0}), registry)


def test_an_engine_with_an_unknown_method_fails_at_start(gqa_dir):
    with pytest.raises(UnknownImplementationError, match="--speculative-config"):
        make_llm(gqa_dir, speculative_config={"method": "medusa"})


@pytest.mark.parametrize("value, message", [
    ([4], "expected an object"),
    ({"k": 2}, "unknown key.*'k'.*num_speculative_tokens, method, model"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an integer from 1 to 16, got 0"),
    ({"num_speculative_tokens": 2.5}, "num_speculative_tokens must be an integer from 1 to 16, got 2.5"),
    ({"method": ""}, "method must be a non-empty string"),
])
def test_a_requests_speculative_config_is_checked_on_its_own(value, message):
    with pytest.raises(InvalidRequestError, match=f"speculative_config: {message}") as info:
        SamplingParams(speculative_config=value)
    assert info.value.param == "speculative_config"


def test_a_requests_speculative_config_is_checked_against_the_engine(gqa_dir, fresh_llm, references):
    llm = replay_llm(gqa_dir, references, k=3)
    engine = llm.engine
    for value, message in [
        ({"num_speculative_tokens": 4}, "num_speculative_tokens 4 is above this engine's 3 .*give 1 to 3"),
        ({"method": "eagle"}, "method 'eagle': no proposer is named 'eagle' \\(registered: draft_model, ngram, "
                              "replay\\), and this engine speculates with 'replay'"),
        ({"method": "ngram"}, "method 'ngram': 'ngram' is installed, and this engine speculates with 'replay'"),
        ({"model": "/models/small"}, "model '/models/small': method 'replay' uses no draft model"),
    ]:
        with pytest.raises(InvalidRequestError, match=f"speculative_config: {message}") as info:
            engine.add_request(prompt="x", params=greedy(4, speculative_config=value))
        assert info.value.param == "speculative_config"
    assert not engine.has_unfinished_requests()
    with pytest.raises(InvalidRequestError, match="this engine does not speculate; drop it, or start the engine with "
                                                  "--speculative-config"):
        fresh_llm().generate("x", greedy(4, speculative_config={"num_speculative_tokens": 1}))
    # a smaller k for one request: its drafts have at most that many tokens, the output is the same
    outs = llm.generate(PROMPTS, [greedy(40, speculative_config={"num_speculative_tokens": 1, "method": "replay"})] * 4)
    assert token_ids(outs) == [references[tuple(o.prompt_token_ids)] for o in outs]
    stats = engine.stats()
    assert stats["spec_num_draft_tokens"] == stats["spec_num_drafts"] > 0
    assert stats["spec_accepted_per_position"][1:] == [0, 0]


def test_the_server_passes_a_requests_speculative_config_on():
    from fw.server.convert import sampling_params
    from fw.server.protocol import ChatCompletionRequest, CompletionRequest

    got = sampling_params(CompletionRequest(prompt="x", speculative_config={"num_speculative_tokens": 2}), 4, None)
    assert got.speculative_config == {"num_speculative_tokens": 2}
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], speculative_config={"k": 1})
    with pytest.raises(InvalidRequestError, match="speculative_config: unknown key"):
        sampling_params(chat, 4, None)


# -- the rejection rule, against exact probabilities ---------------------------------------------------------------


def test_residual_of_a_point_mass_removes_the_token_and_renormalises():
    p = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    point = torch.tensor([0.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    assert torch.allclose(residual(p, point), torch.tensor([1 / 7, 2 / 7, 0.0, 4 / 7], dtype=torch.float64))
    # exact marginal of the first emitted token: accept x w.p. p(x), else the residual
    for x in range(4):
        point = torch.nn.functional.one_hot(torch.tensor(x), 4).double()
        first = p[x] * point + (1 - p[x]) * residual(p, point)
        assert torch.allclose(first, p)
    assert torch.equal(residual(p, p), p)  # nothing left over: p itself (that case never rejects)


def test_accepted_prefix_is_the_run_of_matching_draws():
    assert accepted_prefix([5, 6, 7, 8], [5, 6, 9]) == 2
    assert accepted_prefix([5, 6, 7, 8], [5, 6, 7]) == 3
    assert accepted_prefix([1, 6], [5]) == 0


def _tv(counts: np.ndarray, p: np.ndarray) -> float:
    return 0.5 * float(np.abs(counts / counts.sum() - p).sum())


def _chi_square_ok(counts: np.ndarray, p: np.ndarray) -> bool:
    """Pearson's statistic below the 0.999 quantile (Wilson-Hilferty), over the outcomes with mass."""
    mask = p > 0
    n = counts.sum()
    stat = float((((counts - n * p) ** 2)[mask] / (n * p[mask])).sum())
    dof = int(mask.sum()) - 1
    z = 3.09  # the 0.999 quantile of N(0, 1)
    limit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    return stat < limit


@pytest.mark.parametrize("probabilistic", [False, True])
def test_rejection_sampling_keeps_the_target_distribution(probabilistic):
    """100k draws of the rule on a 6-token vocabulary with random p (and q): the first emitted token is
    distributed as p[0], and after an accepted first draft token the second as p[1]. Exact probabilities,
    chi-square at 0.999 and total variation within sampling error."""
    vocab, k, n = 6, 2, 100_000
    g = torch.Generator().manual_seed(1 if probabilistic else 2)
    p = torch.softmax(torch.randn(k + 1, vocab, generator=g, dtype=torch.float64) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(k, vocab, generator=g, dtype=torch.float64) * 1.5, dim=-1) if probabilistic else None
    draw = torch.Generator().manual_seed(7)
    first = np.zeros(vocab)
    second = np.zeros(vocab)
    for _ in range(n):
        if probabilistic:
            draft = [int(torch.multinomial(q[j], 1, generator=draw)) for j in range(k)]
        else:
            draft = [2, 4]
        emitted, accepted = verify(p, draft, q, generator=draw)
        assert len(emitted) == accepted + 1 and emitted[:accepted] == draft[:accepted]
        first[emitted[0]] += 1
        if accepted >= 1:
            second[emitted[1]] += 1
    p0, p1 = p[0].numpy(), p[1].numpy()
    assert _chi_square_ok(first, p0) and _tv(first, p0) < 0.01
    assert _chi_square_ok(second, p1) and _tv(second, p1) < 4 / math.sqrt(second.sum())


def test_greedy_point_masses_accept_iff_argmax():
    p = torch.nn.functional.one_hot(torch.tensor([3, 1, 0]), 5).double()
    assert verify(p, [3, 1]) == ([3, 1, 0], 2)
    assert verify(p, [3, 2]) == ([3, 1], 1)
    assert verify(p, [4, 1]) == ([3], 0)


# -- the engine: greedy output identical to decoding without speculation -------------------------------------------


def test_ngram_greedy_outputs_match_without_speculation(gqa_dir, base):
    params = greedy(40)
    want = token_ids(base.generate(PROMPTS, params))
    llm = make_llm(gqa_dir, speculative_config=NGRAM)
    assert token_ids(llm.generate(PROMPTS, params)) == want
    stats = llm.engine.stats()
    assert stats["spec_num_drafts"] > 0 and stats["spec_num_draft_tokens"] >= stats["spec_num_drafts"]
    assert stats["num_running"] == 0 and llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_repetitive_output_is_accepted_and_identical(gqa_dir, base):
    """A prompt of one repeated token: the tiny model keeps repeating it, and ngram's drafts get accepted."""
    prompt = {"prompt_token_ids": [160] * 12}
    params = greedy(32)
    want = base.generate(prompt, params)[0].outputs[0].token_ids
    llm = make_llm(gqa_dir, speculative_config=NGRAM)
    out = llm.generate(prompt, params)[0]
    assert out.outputs[0].token_ids == want
    if len(set(want)) == 1:  # it loops (this checkpoint does): nearly every draft token is accepted
        assert out.metrics["spec_num_accepted_tokens"] >= 20
    assert out.metrics["spec_num_accepted_tokens"] > 0


@pytest.mark.parametrize("wrong_at", [None, 0, 2])
def test_replayed_drafts_fully_or_partly_accepted_give_the_same_tokens(gqa_dir, references, wrong_at):
    llm = replay_llm(gqa_dir, references, wrong_at)
    outs = llm.generate(PROMPTS, greedy(40))
    assert token_ids(outs) == [references[tuple(o.prompt_token_ids)] for o in outs]
    stats = llm.engine.stats()
    drafted, accepted = stats["spec_num_draft_tokens"], stats["spec_num_accepted_tokens"]
    if wrong_at is None:  # every draft token was right: each verify pass emits k + 1 tokens
        assert accepted == drafted > 0
        per_position = stats["spec_accepted_per_position"]
        assert per_position[0] == stats["spec_num_drafts"] and sum(per_position) == accepted
        assert per_position == sorted(per_position, reverse=True)  # the last drafts are cut by max_tokens
        assert stats["spec_mean_acceptance_length"] == pytest.approx(1 + accepted / stats["spec_num_drafts"])
        # 4 prompts x 40 tokens, 5 per pass (the first token comes from the prefill)
        assert stats["spec_num_drafts"] <= 4 * math.ceil(39 / 5) + 4
    elif wrong_at == 0:
        assert accepted == 0 and stats["spec_num_pauses"] > 0
    else:  # the first two of each draft are right, and the position two counter never moves
        per_position = stats["spec_accepted_per_position"]
        assert per_position[0] == per_position[1] > 0 and per_position[2] == per_position[3] == 0
    for out in outs:  # per request too
        assert out.metrics["spec_num_draft_tokens"] >= out.metrics["spec_num_accepted_tokens"]
    assert len(llm.proposer.released) == len(PROMPTS)  # every finished sequence was released


def test_mixed_batch_with_opt_out_and_prefill_chunks(gqa_dir, base, references):
    """Speculating and opted-out requests in one batch, prompts prefilled in small chunks while others verify."""
    long_prompt = " ".join(["the engine schedules every request in pages"] * 6)
    prompts = PROMPTS + [long_prompt]
    params = [greedy(40), greedy(40, speculative=False), greedy(40), greedy(40, speculative=False), greedy(20)]
    want = token_ids(base.generate(prompts, params))
    llm = replay_llm(gqa_dir, references, wrong_at=3, prefill_chunk_size=8, max_batch_input_tokens=24)
    steps: list[list[int]] = []
    runner, execute = llm.engine.runner, llm.engine.runner.execute

    def record(seqs, num_new):
        steps.append([len(s.draft_token_ids) + 1 if s.draft_token_ids else -n for s, n in zip(seqs, num_new)])
        return execute(seqs, num_new)

    runner.execute = record
    engine = llm.engine
    ids = [engine.add_request(prompt=p, params=sp).request_id for p, sp in zip(prompts[:4], params[:4])]
    for _ in range(3):
        engine.step()
    ids.append(engine.add_request(prompt=prompts[4], params=params[4]).request_id)  # joins mid-flight, chunked
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert [final[i].outputs[0].token_ids for i in ids] == want
    assert any(any(n > 1 for n in step) and any(n < -1 for n in step) for step in steps), \
        "no step verified a draft while another sequence prefilled a chunk"
    assert "spec_num_drafts" not in final[ids[1]].metrics and "spec_num_drafts" not in final[ids[3]].metrics
    assert final[ids[0]].metrics["spec_num_drafts"] > 0


def test_preemption_with_speculation_gives_the_same_tokens(gqa_dir, references):
    small = dict(num_kv_blocks=20, kv_cache_page_size=4)
    want_llm = make_llm(gqa_dir, **small)
    want = token_ids(want_llm.generate(PROMPTS, greedy(30)))
    llm = replay_llm(gqa_dir, references, wrong_at=2, **small)
    assert token_ids(llm.generate(PROMPTS, greedy(30))) == want
    assert llm.engine.stats()["num_preemptions"] > 0
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_sampled_drafts_with_probabilities_verify_exactly_under_greedy(gqa_dir, references):
    """A proposer that gives draft probabilities goes through min(1, p/q); greedy p is a point mass."""
    llm = replay_llm(gqa_dir, references, wrong_at=1, with_probs=True)
    outs = llm.generate(PROMPTS, greedy(40, logprobs=2))
    assert token_ids(outs) == [references[tuple(o.prompt_token_ids)] for o in outs]
    stats = llm.engine.stats()
    assert stats["spec_accepted_per_position"][0] > 0 and stats["spec_accepted_per_position"][1] == 0
    for out in outs:
        lps = out.outputs[0].logprobs
        assert len(lps) == 40 and all(t in lp for t, lp in zip(out.outputs[0].token_ids, lps))


def test_logprobs_come_from_the_target(gqa_dir, base, references):
    params = greedy(24, logprobs=3)
    want = base.generate(PROMPTS, params)
    got = replay_llm(gqa_dir, references, wrong_at=2).generate(PROMPTS, params)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs):
            assert set(lw) == set(lg)
            for t in lw:
                assert lg[t].logprob == pytest.approx(lw[t].logprob, abs=1e-4) and lg[t].rank == lw[t].rank
        assert g.outputs[0].cumulative_logprob == pytest.approx(w.outputs[0].cumulative_logprob, abs=1e-3)


@pytest.mark.parametrize("wrong_at", [None, 1])
def test_seeded_sampling_is_identical_with_and_without_speculation(gqa_dir, base, wrong_at):
    """Deterministic drafts are verified by the request's own draws; the generator is rewound over rejected
    positions, so a seeded request draws what it would without speculation: the same tokens."""
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=s, max_tokens=32, ignore_eos=True,
                             repetition_penalty=1.1) for s in (1, 2, 3, 4)]
    want = base.generate(PROMPTS, params)
    refs = {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in want}
    llm = replay_llm(gqa_dir, refs, wrong_at)
    got = llm.generate(PROMPTS, params)
    assert token_ids(got) == token_ids(want)
    stats = llm.engine.stats()
    assert stats["spec_num_accepted_tokens"] > 0
    again = replay_llm(gqa_dir, refs, wrong_at).generate(PROMPTS, params)
    assert token_ids(again) == token_ids(got)  # and run to run


# -- stop rules truncate the accepted run; KV pages come back ------------------------------------------------------


def test_max_tokens_and_stop_rules_cut_the_accepted_run(gqa_dir, base, references):
    llm = replay_llm(gqa_dir, references)
    prompt = PROMPTS[1]
    ref = references[tuple(llm.tokenizer(prompt).input_ids)]
    for n in (1, 2, 6, 7):  # ends inside a verify pass's accepted run, or at its bonus token
        out = llm.generate(prompt, greedy(n))[0].outputs[0]
        assert out.token_ids == ref[:n] and out.finish_reason == "length"
    stop_id = ref[7]
    first = ref.index(stop_id)
    out = llm.generate(prompt, greedy(40, stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == ref[:first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_id
    text = base.generate(prompt, greedy(40))[0].outputs[0].text
    stop = text[len(text) // 3:len(text) // 3 + 4]
    want = base.generate(prompt, greedy(40, stop=[stop]))[0].outputs[0]
    got = llm.generate(prompt, greedy(40, stop=[stop]))[0].outputs[0]
    assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == (
        want.text, want.token_ids, want.finish_reason, want.stop_reason)
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_rejected_positions_give_their_pages_back(gqa_dir, references):
    """After every step a sequence holds the pages of its computed tokens only, as without speculation;
    pages taken for rejected draft tokens go back to the free list."""
    llm = replay_llm(gqa_dir, references, wrong_at=0, kv_cache_page_size=2)
    engine, blocks = llm.engine, llm.engine.blocks
    baseline = blocks.num_free_blocks
    engine.add_request(prompt=PROMPTS[2], params=greedy(30))
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            assert len(seq.block_table) == blocks.blocks_needed(seq.num_computed_tokens)
            assert seq.num_computed_tokens == seq.num_tokens - 1
        assert blocks.num_free_blocks == baseline - sum(len(s.block_table) for s in engine.scheduler.running)
    assert engine.stats()["spec_num_drafts"] > 0
    assert blocks.num_free_blocks == baseline


def test_prefix_cache_keys_stay_consistent(gqa_dir, base, references):
    """Pages filled by verify passes are published under their accepted tokens: a later request whose
    prompt is an earlier prompt + output hits them and continues as it would without speculation."""
    llm = replay_llm(gqa_dir, references, wrong_at=2)
    prompt_ids = llm.tokenizer(PROMPTS[3]).input_ids
    first = llm.generate({"prompt_token_ids": prompt_ids}, greedy(40))[0].outputs[0].token_ids
    follow = {"prompt_token_ids": prompt_ids + first[:30]}
    out = llm.generate(follow, greedy(8, speculative=False))[0]
    assert out.num_cached_tokens >= 16
    assert out.outputs[0].token_ids == base.generate(follow, greedy(8))[0].outputs[0].token_ids


# -- grammar, batch size, acceptance ------------------------------------------------------------------------------


def test_grammar_constrained_requests_verify_against_the_masked_distribution(gqa_dir, references):
    from test_grammar_core import CHOICES, service_for

    params = SamplingParams(temperature=0, max_tokens=20, structured_outputs={"choice": CHOICES})
    plain = make_llm(gqa_dir)
    plain.engine.grammar, _ = service_for(plain.engine)
    want = plain.generate(PROMPTS, params)
    refs = {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in want}
    for wrong_at in (None, 1):
        llm = replay_llm(gqa_dir, refs, wrong_at)
        llm.engine.grammar, _ = service_for(llm.engine)
        got = llm.generate(PROMPTS, params)
        assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
        assert all(o.outputs[0].text in CHOICES for o in got)
        assert llm.engine.stats()["spec_num_accepted_tokens"] > 0


def test_large_batches_do_not_speculate(gqa_dir, references):
    llm = replay_llm(gqa_dir, references, spec={"disable_by_batch_size": 3})
    outs = llm.generate(PROMPTS, greedy(12))
    assert token_ids(outs) == [references[tuple(o.prompt_token_ids)][:12] for o in outs]
    stats = llm.engine.stats()
    assert stats["spec_num_steps_disabled_by_batch"] > 0
    # drafts only once fewer than 3 sequences ran: never here, the four finish together
    assert stats["spec_num_drafts"] == 0


def test_best_k_follows_the_acceptance():
    from fw.speculative.service import best_k

    assert [best_k(a, 4) for a in (1.0, 0.98, 0.9, 0.6, 0.5, 0.3, 0.0)] == [4, 4, 4, 3, 2, 1, 1]
    assert best_k(0.9, 8) == 8 and best_k(0.75, 8) == 5
    assert best_k(0.9, 4, cost=1.0) == 1  # when a draft token costs a whole decode, one is the most that pays


def test_adaptive_k_shortens_the_drafts_of_a_sequence_whose_drafts_fail_early(gqa_dir, references):
    """Every draft's token at position 1 is wrong: one token is accepted per draft (acceptance 1/2 given the
    ones before), so the sequence drafts 2 tokens instead of 4; without adaptive_k it keeps drafting 4.
    The output is the same either way."""
    lengths = {}
    for adaptive in (True, False):
        llm = replay_llm(gqa_dir, references, wrong_at=1,
                         spec={"adaptive_k": adaptive, "min_acceptance_rate": 0.0})
        out = llm.generate(PROMPTS[3], greedy(40))[0]
        assert out.outputs[0].token_ids == references[tuple(out.prompt_token_ids)]
        stats = llm.engine.stats()
        lengths[adaptive] = stats["spec_num_draft_tokens"] / stats["spec_num_drafts"]
        assert stats["spec_accepted_per_position"][0] == stats["spec_num_drafts"]
    assert lengths[False] > 3.5 and lengths[True] < 2.5


def test_low_acceptance_pauses_a_sequence(gqa_dir, references):
    llm = replay_llm(gqa_dir, references, wrong_at=0)
    llm.generate(PROMPTS[0], greedy(60))
    stats = llm.engine.stats()
    assert stats["spec_num_accepted_tokens"] == 0 and stats["spec_num_pauses"] >= 2
    # paused for 4, then 8, then 16 steps: far fewer drafts than decode steps
    assert stats["spec_num_drafts"] < 20


# -- the fronts: the server's opt-out, /metrics, fw bench's copy workload ---------------------------------------


def test_the_server_maps_the_opt_out_and_exposes_the_counters(fresh_llm):
    from prometheus_client import generate_latest

    from fw.server.convert import sampling_params
    from fw.server.metrics import ServerMetrics
    from fw.server.protocol import CompletionRequest

    assert sampling_params(CompletionRequest(prompt="x"), 4, None).speculative is True
    assert sampling_params(CompletionRequest(prompt="x", speculative=False), 4, None).speculative is False
    llm = fresh_llm(speculative_config=NGRAM)
    llm.generate({"prompt_token_ids": [160] * 12}, greedy(16))
    stats = llm.engine.stats()
    text = generate_latest(ServerMetrics("m", "sdpa", lambda: stats).registry).decode()
    assert f"fw_spec_decode_num_drafts_total{{attention_backend=\"sdpa\",model_name=\"m\"}} {stats['spec_num_drafts']}.0" \
        in text
    assert "fw_spec_decode_num_accepted_tokens_total" in text and "fw_spec_decode_mean_acceptance_length" in text
    assert 'position="3"' in text


def test_copy_workload_prompts_repeat_a_passage(tokenizer):
    from fw.commands.bench.offline import make_prompts, speculation

    (a, b) = make_prompts(tokenizer, [60, 10], seed=1, workload="copy")
    assert len(a) == 60 and len(b) == 10
    period = len(make_prompts(tokenizer, [20], seed=1)[0])  # the passage: a third of 60
    assert period == 20 and a[:20] == a[20:40] == a[40:60]
    assert make_prompts(tokenizer, [60], seed=1, workload="copy") == [a]
    before = {"spec_num_drafts": 1, "spec_num_draft_tokens": 4, "spec_num_accepted_tokens": 2}
    after = {"spec_num_drafts": 3, "spec_num_draft_tokens": 12, "spec_num_accepted_tokens": 8}
    assert speculation(before, after) == {"num_drafts": 2, "num_draft_tokens": 8, "num_accepted_tokens": 6,
                                          "acceptance_rate": 0.75, "mean_acceptance_length": 4.0}
    assert speculation({}, {"num_running": 0}) is None


def test_bench_compares_with_and_without_speculation_on_one_engine(gqa_dir, tmp_path, capsys, isolated_plugins):
    """`--baseline no-speculation`: the same engine with every request opted out, taking turns with fw on
    prompts of its own (fw's prefix cache must not serve them)."""
    import json

    from fw.cli.main import main

    out = tmp_path / "r.json"
    args = ["bench", "throughput", "--model", str(gqa_dir), "--dtype", "float32", "--num-prompts", "3",
            "--input-len", "40", "--input-len-range", "0", "--output-len", "16", "--num-passes", "2",
            "--workload", "copy", "--num-kv-blocks", "64", "--no-progress", "--baseline", "no-speculation"]
    assert main([*args, "--speculative-config", json.dumps(NGRAM), "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["baseline_info"]["name"] == "no-speculation"
    assert all(p["output_tokens"] == 3 * 16 for side in ("fw", "baseline") for p in report["passes"][side])
    assert report["fw"]["speculative"]["num_drafts"] > 0
    assert "fw/no-spe" in capsys.readouterr().out
    assert main(args) != 0
    assert "--baseline no-speculation compares fw with and without speculative decoding; give " \
           "--speculative-config too" in capsys.readouterr().err
