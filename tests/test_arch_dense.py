"""The dense families beyond Llama against transformers on the same fp32 weights:
Gemma, Gemma 2, Gemma 3, Qwen2, Qwen3 and Mistral. Four prompts (12-40 tokens, all
longer than the sliding window of 8) go in one batch; fw's greedy tokens must equal
transformers' `generate(do_sample=False)` for 32 new tokens and the logprobs agree
within 1e-3. Chunked prefill runs on two sliding-window models. Each family's
distinguishing feature is shown to matter: without the window or the soft-caps,
transformers itself produces other tokens or logprobs, so a model that ignored them
could not pass."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import dense_models
from conftest import make_llm, record_steps
from fw import SamplingParams
from fw.errors import UnsupportedConfigurationError
from test_parity import LAYOUTS, hf_greedy

PROMPTS = [
    "The engine schedules every request in pages of keys and values.",
    "one two three four five six seven eight nine ten hundred thousand first second last next every",
    "Paris is the capital of France. Berlin is the capital of",
    "def add(a, b):\n    return a + b",
]
NEW_TOKENS = 32
TOL = 1e-3
WINDOWED = ("gemma2", "gemma3", "qwen2", "mistral")
FAMILIES = ("gemma", "gemma2", "gemma3", "qwen2", "qwen3", "mistral")
ARCH_NAMES = {"gemma": "gemma", "gemma2": "gemma2", "gemma3": "gemma3", "qwen2": "qwen2", "qwen3": "qwen3",
              "mistral": "llama"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer):
    """family -> checkpoint directory, built on first use."""
    root = tmp_path_factory.mktemp("dense")
    cache = {}

    def get(name: str, **overrides):
        key = (name, tuple(sorted(overrides.items())))
        if key not in cache:
            cache[key] = dense_models.build(name, tokenizer, root / f"{name}_{len(cache)}", **overrides)
        return cache[key]

    return get


@pytest.fixture(scope="module")
def references(checkpoints, tokenizer):
    """family -> [(prompt ids, greedy tokens, per-step logprobs)] from transformers."""
    cache = {}

    def get(name: str, hf=None):
        if name not in cache:
            hf = hf or dense_models.load_hf(name, checkpoints(name))
            cache[name] = [(ids, *hf_greedy(hf, ids, NEW_TOKENS)) for ids in (tokenizer(p).input_ids for p in PROMPTS)]
        return cache[name]

    return get


def _check(outputs, refs) -> None:
    for out, (ids, ref_tokens, ref_logprobs) in zip(outputs, refs):
        assert out.prompt_token_ids == ids
        got = out.outputs[0]
        assert got.token_ids == ref_tokens, f"prompt {out.prompt!r}"
        for pos, (entry, ref) in enumerate(zip(got.logprobs, ref_logprobs)):
            assert set(entry) == set(torch.topk(ref, 2).indices.tolist()), pos
            for tid in entry:
                assert abs(entry[tid].logprob - ref[tid].item()) < TOL, (pos, tid)


def _generate(llm):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    return llm.generate(PROMPTS, params)


# `auto` picks cpu_paged on CPU (windows and soft-caps in its C++ kernel); sdpa is the reference backend
@pytest.mark.parametrize("backend", ["auto", "sdpa"])
@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_tokens_and_logprobs_match_transformers(name, backend, checkpoints, references):
    refs = references(name)
    for ids, tokens, _ in refs:
        assert 12 <= len(ids) <= 40 and len(ids) > dense_models.WINDOW
        assert len(set(tokens)) >= 8, f"degenerate reference text {tokens}"  # the weights make varied text
    llm = make_llm(checkpoints(name), attention_backend=backend)
    loaded = llm.engine.loaded
    assert loaded.architecture.name == ARCH_NAMES[name]
    assert loaded.attention.chosen.name == ("cpu_paged" if backend == "auto" else "sdpa")
    steps = record_steps(llm)
    _check(_generate(llm), refs)
    assert max(len(s) for s in steps) == len(PROMPTS)  # the prompts really shared steps


@pytest.mark.parametrize("name", ["gemma2", "mistral"])
def test_chunked_prefill_with_sliding_window_matches_transformers(name, checkpoints, references):
    llm = make_llm(checkpoints(name), **LAYOUTS["chunked"])
    steps = record_steps(llm)
    _check(_generate(llm), references(name))
    assert max(max(s) for s in steps) <= LAYOUTS["chunked"]["prefill_chunk_size"]
    assert any(1 in s and max(s) > 1 for s in steps), "no step mixed decodes with prefill chunks"


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "qwen2", "mistral"])
def test_the_window_changes_the_output(name, checkpoints, references):
    """The same weights without the window (8 -> 256) generate other text: the window bites."""
    hf = dense_models.load_hf(name, checkpoints(name, sliding_window=256))
    wide = [hf_greedy(hf, ids, NEW_TOKENS)[0] for ids, _, _ in references(name)]
    assert any(w != tokens for w, (_, tokens, _) in zip(wide, references(name)))


def test_gemma2_soft_caps_change_the_output(checkpoints, references):
    refs = references("gemma2")
    hf = dense_models.load_hf("gemma2", checkpoints("gemma2"))
    for layer in hf.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    uncapped = [hf_greedy(hf, ids, NEW_TOKENS)[0] for ids, _, _ in refs]
    assert any(u != tokens for u, (_, tokens, _) in zip(uncapped, refs)), "attention soft-capping does not bite"

    hf = dense_models.load_hf("gemma2", checkpoints("gemma2"))
    hf.config.final_logit_softcapping = None  # monotonic: same tokens, other logprobs
    ids, tokens, logprobs = refs[0]
    got, raw = hf_greedy(hf, ids, NEW_TOKENS)
    assert got == tokens
    assert max(abs(a[t] - b[t]).item() for a, b, t in zip(logprobs, raw, tokens)) > 0.1


def test_gemma3_global_layers_use_their_own_rope(checkpoints, tokenizer):
    """Gemma 3's sliding layers rotate with the local base, its full-attention layers with the
    global base and its linear scaling (the parity test checks the result end to end)."""
    from fw.layers.rotary import rope_inv_freq
    from fw.model.config import ModelConfig

    config = ModelConfig.from_hf(dense_models.make_config("gemma3", tokenizer))
    local, _ = rope_inv_freq(config.rope_for("sliding_attention"), 16)
    full, _ = rope_inv_freq(config.rope_for("full_attention"), 16)
    assert torch.allclose(local, 1.0 / 10000.0 ** (torch.arange(0, 16, 2).float() / 16))
    assert torch.allclose(full, 1.0 / 1000000.0 ** (torch.arange(0, 16, 2).float() / 16) / 4.0)
    llm = make_llm(checkpoints("gemma3"))
    rotary = llm.engine.loaded.model.model.rotary
    assert set(rotary) == {"sliding_attention", "full_attention"}
    assert not torch.equal(rotary["sliding_attention"].cos, rotary["full_attention"].cos)


@pytest.mark.usefixtures("isolated_plugins")
def test_a_backend_without_window_or_softcap_is_refused_and_auto_skips_it(checkpoints):
    """Both built-in backends apply windows and soft-caps; a backend that declares neither (here a copy
    of sdpa's spec, preferred by priority) is refused with the reasons, and auto passes it over."""
    from plugin_fixtures import builtin_manager

    manager = builtin_manager()
    backends = manager.registry("attention_backend")
    plain = dataclasses.replace(backends.get("sdpa"), name="plain", priority=100,
                                supports_sliding_window=False, supports_logit_softcap=False)
    backends.add(plain, plugin="tests", distribution="tests")
    with pytest.raises(UnsupportedConfigurationError, match="sliding-window attention not supported") as err:
        make_llm(checkpoints("mistral"), attention_backend="plain", plugins=manager)
    assert "cpu_paged" in str(err.value) and "sdpa" in str(err.value)  # names the backends that would work
    with pytest.raises(UnsupportedConfigurationError, match="soft-capping not supported"):
        make_llm(checkpoints("gemma2"), attention_backend="plain", plugins=manager)
    auto = make_llm(checkpoints("gemma2"), plugins=manager).engine.loaded.attention
    assert auto.chosen.name == "cpu_paged"
    assert "sliding-window attention not supported" in auto.rejected["plain"]
    assert "attention logit soft-capping not supported" in auto.rejected["plain"]
    no_window = make_llm(checkpoints("qwen3"), plugins=manager).engine.loaded.attention
    assert no_window.chosen.name == "plain"  # a model without windows or caps may use it


def test_qwen2_without_use_sliding_window_needs_no_window(checkpoints):
    """use_sliding_window=False: transformers clears the window, so every backend may run it."""
    path = checkpoints("qwen2", use_sliding_window=False)
    loaded = make_llm(path).engine.loaded
    assert all(layer.self_attn.attn.impl.sliding_window is None for layer in loaded.model.model.layers)
    assert "cpu_paged" not in loaded.attention.rejected or \
        "sliding-window attention not supported" not in loaded.attention.rejected["cpu_paged"]


def test_architectures_are_listed_with_their_plugins():
    from plugin_fixtures import plugins_json, run_fw

    rows = plugins_json(run_fw("plugins", "list", "--json", "--kind", "architecture"))
    assert rows["gemma"]["provides"]["architecture"] == ["gemma", "gemma2", "gemma3"]
    assert rows["qwen"]["provides"]["architecture"] == ["qwen2", "qwen3"]
    from fw.plugins.manager import get_plugin_manager

    registry = get_plugin_manager().registry("architecture")
    claimed = {hf: spec.name for spec in registry for hf in spec.hf_architectures}
    for hf_name, spec_name in [("GemmaForCausalLM", "gemma"), ("Gemma2ForCausalLM", "gemma2"),
                               ("Gemma3ForCausalLM", "gemma3"), ("Qwen2ForCausalLM", "qwen2"),
                               ("Qwen3ForCausalLM", "qwen3"), ("MistralForCausalLM", "llama")]:
        assert claimed[hf_name] == spec_name
        assert registry.get(spec_name).description


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_gemma_runs_in_bfloat16(name, checkpoints, references):
    """bf16 (the CPU default where native): Gemma's fp32 norm scales and embedding normalizer
    must hand bf16 on to the next layer. Prompt logprobs stay near the fp32 reference (bf16 on
    these wide random weights moves transformers' own logprobs by up to about 0.8)."""
    from fw import LLM

    llm = LLM(model=str(checkpoints(name)), dtype="bfloat16", num_kv_blocks=64)
    ids, _, _ = references(name)[0]
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=0))[0]
    assert len(out.outputs[0].token_ids) == 4
    hf = dense_models.load_hf(name, checkpoints(name))
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    diffs = [abs(out.prompt_logprobs[j][ids[j]].logprob - ref[j - 1, ids[j]].item()) for j in range(1, len(ids))]
    assert max(diffs) < 1.5
