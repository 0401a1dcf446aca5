"""The transformers fallback (`--model-impl transformers`, the `transformers` architecture plugin):
architectures fw has no native plugin for run through transformers' modelling code over fw's paged
KV cache and attention backend, and match transformers itself (greedy tokens identical, logprobs
within 1e-3 at fp32) with several requests batched into each step; plus how `--model-impl` chooses
and what it says when it cannot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig

import plugin_fixtures as pf
from conftest import make_llm, record_steps
from fw import SamplingParams
from fw.config import resolve_config
from fw.errors import ConfigError, UnsupportedArchitectureError, UnsupportedConfigurationError

PROMPTS = [
    "Hello world",
    "The engine schedules every request in pages of keys and values.",
    "a",
    "Once upon a time, in a small village by the river, there lived an old clockmaker.",
]
NEW_TOKENS = 32
TOL = 1e-3
PAGED = {"kv_cache_page_size": 4, "num_kv_blocks": 128}  # small pages: every sequence spans many
CHUNKED = {**PAGED, "prefill_chunk_size": 5, "max_batch_input_tokens": 12}  # decodes mixed with chunks


def _tiny_config(kind: str, tokenizer):
    from transformers import Gemma2Config, GPTNeoXConfig, PhiConfig

    common = dict(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=128, max_position_embeddings=256, bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    if kind == "gpt_neox":  # parallel residual, partial rotary (a quarter of each head), LayerNorm, fused QKV
        return GPTNeoXConfig(**common, rotary_pct=0.25, tie_word_embeddings=False,
                             architectures=["GPTNeoXForCausalLM"])
    if kind == "phi":  # GQA (2 KV heads), half-rotary heads, QK LayerNorm, biased head, parallel block
        return PhiConfig(**common, num_key_value_heads=2, partial_rotary_factor=0.5, qk_layernorm=True,
                         tie_word_embeddings=False, architectures=["PhiForCausalLM"])
    # Gemma 2 (native in fw; run here with --model-impl transformers): what HF passes with each attention
    # call (a sliding window shorter than the prompts on layer 0, attention soft-cap, a scale from
    # query_pre_attn_scalar) and what it applies after its head (final soft-cap, small enough to bite).
    return Gemma2Config(**common, num_key_value_heads=2, head_dim=16, sliding_window=6, query_pre_attn_scalar=24,
                        attn_logit_softcapping=20.0, final_logit_softcapping=8.0,
                        architectures=["Gemma2ForCausalLM"])


FINAL_NORMS = {"gpt_neox": ("final_layer_norm", 4.0), "phi": ("final_layernorm", 4.0), "gemma2": ("norm", 3.0)}


def _save_tiny(kind: str, tokenizer, path: Path) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)  # every prompt's greedy text has 13+ distinct tokens with this seed
    model = AutoModelForCausalLM.from_config(_tiny_config(kind, tokenizer)).float()
    # As tests/tiny_models.py: wider weights and a large final-norm scale give varied greedy text
    # with a peaked distribution, so no greedy choice is decided by rounding noise.
    embed_std = 0.05 if kind == "gemma2" else 0.1  # Gemma scales its embeddings by sqrt(hidden)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, embed_std if "embed" in name or "lm_head" in name else 0.3)
        norm, scale = FINAL_NORMS[kind]
        getattr(model.get_decoder(), norm).weight.fill_(scale)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory, tokenizer) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fallback_models")
    return {kind: _save_tiny(kind, tokenizer, root / kind) for kind in FINAL_NORMS}


def _hf_reference(path: Path, prompts_ids: list[list[int]]) -> list[tuple[list[int], list[torch.Tensor]]]:
    """transformers' own greedy continuation (eager attention, fp32) and each step's log-softmax."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    config = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0,
                              output_logits=True, return_dict_in_generate=True)
    refs = []
    with torch.no_grad():
        for ids in prompts_ids:
            out = hf.generate(torch.tensor([ids]), generation_config=config, attention_mask=torch.ones(1, len(ids)))
            refs.append((out.sequences[0, len(ids):].tolist(),
                         [torch.log_softmax(step[0].float(), dim=-1) for step in out.logits]))
    return refs


@pytest.fixture(scope="module")
def references(tiny_dirs, tokenizer) -> dict[str, list]:
    ids = [tokenizer(p).input_ids for p in PROMPTS]
    return {kind: _hf_reference(path, ids) for kind, path in tiny_dirs.items()}


def _assert_matches(outputs, refs) -> None:
    for out, (ref_tokens, ref_logprobs) in zip(outputs, refs):
        got = out.outputs[0]
        assert got.token_ids == ref_tokens, f"prompt {out.prompt!r}"
        assert len(set(got.token_ids)) > 4, "degenerate reference: the check would prove little"
        for pos, (entry, ref) in enumerate(zip(got.logprobs, ref_logprobs)):
            assert set(entry) == set(torch.topk(ref, 2).indices.tolist()), pos
            for tid, lp in entry.items():
                assert abs(lp.logprob - ref[tid].item()) < TOL, (pos, tid)


def _generate_batched(llm):
    steps = record_steps(llm)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    outputs = llm.generate(PROMPTS, params)
    assert max(len(s) for s in steps) == len(PROMPTS), "the prompts never shared a step"
    assert any(len(s) > 1 and set(s) == {1} for s in steps), "no step decoded several sequences together"
    return outputs, steps


@pytest.mark.parametrize("backend", ["auto", "sdpa"])
@pytest.mark.parametrize("kind", ["gpt_neox", "phi"])
def test_fallback_matches_transformers(kind, backend, tiny_dirs, references):
    llm = make_llm(tiny_dirs[kind], attention_backend=backend, **PAGED)  # model_impl auto: no native plugin
    assert llm.engine.loaded.architecture.name == "transformers"
    assert llm.engine.loaded.architecture.fallback
    outputs, _ = _generate_batched(llm)
    _assert_matches(outputs, references[kind])
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_fallback_with_chunked_prefill_mixed_into_decode_steps(tiny_dirs, references):
    llm = make_llm(tiny_dirs["gpt_neox"], model_impl="transformers", **CHUNKED)
    outputs, steps = _generate_batched(llm)
    assert max(max(s) for s in steps) <= 5
    assert any(1 in s and max(s) > 1 for s in steps), "no step mixed decodes with prefill chunks"
    _assert_matches(outputs, references["gpt_neox"])


def test_fallback_applies_window_softcaps_and_scale_as_transformers_does(tiny_dirs, references):
    """Gemma 2 through the fallback: the window, attention soft-cap and scale come from each attention
    call, the final soft-cap from HF's own forward after the head."""
    llm = make_llm(tiny_dirs["gemma2"], model_impl="transformers", attention_backend="sdpa", **PAGED)
    assert llm.engine.loaded.architecture.name == "transformers"
    assert [a.impl.sliding_window for a in llm.engine.runner.layers] == [6, None]
    outputs, _ = _generate_batched(llm)
    assert sum(len(o.prompt_token_ids) > 6 for o in outputs) == 3  # the window cuts into three prompts
    _assert_matches(outputs, references["gemma2"])


def test_fallback_prompt_logprobs_match_transformers_forward(tiny_dirs, tokenizer):
    from transformers import AutoModelForCausalLM

    llm = make_llm(tiny_dirs["phi"], **PAGED)
    hf = AutoModelForCausalLM.from_pretrained(tiny_dirs["phi"], dtype=torch.float32).eval()
    for out in llm.generate(PROMPTS[1:], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)):
        ids = out.prompt_token_ids
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
        assert out.prompt_logprobs[0] is None
        for j in range(1, len(ids)):
            assert abs(out.prompt_logprobs[j][ids[j]].logprob - ref[j - 1, ids[j]].item()) < TOL


def test_model_impl_transformers_forces_the_fallback_for_llama(gqa_dir, hf_model, tokenizer):
    """The tiny GQA Llama ties its head to the embeddings: transformers' loader ties them here too."""
    native = make_llm(gqa_dir)
    assert native.engine.loaded.architecture.name == "llama"  # auto prefers the native plugin
    llm = make_llm(gqa_dir, model_impl="transformers", **PAGED)
    assert llm.engine.loaded.architecture.name == "transformers"
    ids = [tokenizer(p).input_ids for p in PROMPTS]
    hf = hf_model(gqa_dir)
    config = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0,
                              output_logits=True, return_dict_in_generate=True)
    refs = []
    with torch.no_grad():
        for prompt_ids in ids:
            out = hf.generate(torch.tensor([prompt_ids]), generation_config=config,
                              attention_mask=torch.ones(1, len(prompt_ids)))
            refs.append((out.sequences[0, len(prompt_ids):].tolist(),
                         [torch.log_softmax(s[0].float(), dim=-1) for s in out.logits]))
    outputs, _ = _generate_batched(llm)
    _assert_matches(outputs, refs)


def test_model_impl_fw_names_the_fallback(tiny_dirs):
    with pytest.raises(UnsupportedArchitectureError) as err:
        make_llm(tiny_dirs["gpt_neox"], model_impl="fw")
    assert "GPTNeoXForCausalLM" in str(err.value)
    assert "--model-impl transformers" in str(err.value)


def _config_only(path: Path, config) -> Path:
    """A model directory with only config.json: the architecture is chosen before anything else loads."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config.to_dict()))
    return path


@pytest.mark.parametrize("impl", ["auto", "transformers"])
def test_models_the_fallback_cannot_run_are_refused_with_the_reason(impl, tmp_path):
    from transformers import BloomConfig, T5Config

    t5 = _config_only(tmp_path / "t5", T5Config(architectures=["T5ForConditionalGeneration"]))
    with pytest.raises(UnsupportedArchitectureError, match="encoder-decoder"):
        make_llm(t5, model_impl=impl)
    # Bloom's attention does not go through transformers' AttentionInterface
    bloom = _config_only(tmp_path / "bloom", BloomConfig(architectures=["BloomForCausalLM"]))
    with pytest.raises(UnsupportedArchitectureError, match="AttentionInterface"):
        make_llm(bloom, model_impl=impl)
    made_up = _config_only(tmp_path / "made_up", BloomConfig(architectures=["MadeUpForCausalLM"]))
    with pytest.raises(UnsupportedArchitectureError, match="no causal-LM class named MadeUpForCausalLM"):
        make_llm(made_up, model_impl=impl)


def test_model_impl_is_an_engine_option():
    assert resolve_config(environ={}).model_impl == "auto"
    assert resolve_config(environ={"FW_MODEL_IMPL": "transformers"}).model_impl == "transformers"
    assert resolve_config(cli={"model_impl": "fw"}, environ={}).model_impl == "fw"
    with pytest.raises(ConfigError, match="--model-impl must be one of auto, fw, transformers"):
        resolve_config(environ={}, model_impl="vllm")


def test_fallback_refuses_fw_quantization_methods(tiny_dirs):
    """transformers' own nn.Linear layers would never call an fw LinearMethod: refuse, do not ignore."""
    from transformers import AutoConfig

    from fw.architectures.transformers_fallback import build
    from fw.layers import ModelContext

    ctx = ModelContext(dtype=torch.float32, device=torch.device("cpu"), attention_backend=object,
                       linear_method=object())
    with pytest.raises(UnsupportedConfigurationError, match="drop --quantization"):
        build(AutoConfig.from_pretrained(tiny_dirs["phi"]), ctx)


def test_attention_function_refuses_unbound_modules():
    from fw.architectures.transformers_fallback import fw_paged_attention

    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(UnsupportedArchitectureError, match="without an fw KV-cache binding"):
        fw_paged_attention(torch.nn.Linear(1, 1), q, q, q, None)


@pytest.mark.usefixtures("isolated_plugins")
def test_cli_lists_the_fallback_and_model_impl_fw_fails(tiny_dirs):
    listing = pf.run_fw("plugins", "list", "--json")
    assert listing.returncode == 0, listing.stderr
    row = pf.plugins_json(listing)["transformers"]
    assert row["distribution"] == "fw" and row["status"] == "loaded"
    assert row["provides"] == {"architecture": ["transformers"]}

    run = pf.run_fw("generate", "--model", str(tiny_dirs["gpt_neox"]), "--prompt", "hi", "--model-impl", "fw")
    assert run.returncode == 2
    assert "--model-impl transformers" in run.stderr and "Traceback" not in run.stderr
