"""Mixtral, Qwen2-MoE and Qwen3-MoE against transformers on the same fp32 weights: identical
greedy tokens and logprobs within 1e-3 for 4 prompts decoded in one batch, with tokens of the
same step routed to different experts; both checkpoint namings of the experts load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GenerationConfig

import tiny_moe
from conftest import make_llm, record_steps
from fw import SamplingParams
from fw.errors import ModelLoadError
from fw.layers import FusedExperts, TopKRouter

PROMPTS = [
    "Hello world",
    "The engine schedules every request in pages of keys and values.",
    "a",
    "def add(a, b):\n    return a + b",
]
NEW_TOKENS = 32
TOL = 1e-3
FAMILIES = [spec.name for spec in tiny_moe.SPECS]
SPECS = {spec.name: spec for spec in tiny_moe.SPECS}


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory, tokenizer) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_moe")
    return {spec.name: tiny_moe.build_model(spec, tokenizer, root / spec.name) for spec in tiny_moe.SPECS}


@pytest.fixture(scope="module")
def hf_refs(moe_dirs, tokenizer):
    """family -> [(prompt ids, greedy tokens, per-step log-softmax)] from transformers' generate."""
    refs = {}
    config = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0,
                              output_logits=True, return_dict_in_generate=True)
    for name, path in moe_dirs.items():
        hf = tiny_moe.load_hf(SPECS[name], path)
        refs[name] = []
        for prompt in PROMPTS:
            ids = tokenizer(prompt).input_ids
            with torch.no_grad():
                out = hf.generate(torch.tensor([ids]), generation_config=config,
                                  attention_mask=torch.ones(1, len(ids)))
            tokens = out.sequences[0, len(ids):].tolist()
            assert len(tokens) == NEW_TOKENS
            refs[name].append((ids, tokens, [torch.log_softmax(s[0].float(), dim=-1) for s in out.logits]))
    return refs


def record_routing(llm) -> list[list[torch.Tensor]]:
    """Per forward step, the expert ids [T, k] every router chose (one tensor per MoE layer)."""
    routers = [m for m in llm.engine.runner.model.modules() if isinstance(m, TopKRouter)]
    assert routers, "the model has no MoE layer"
    steps: list[list[torch.Tensor]] = []

    def hook(module, args, output):
        if module is routers[0]:
            steps.append([])
        steps[-1].append(output[1].clone())

    for router in routers:
        router.register_forward_hook(hook)
    return steps


@pytest.fixture(scope="module")
def fw_runs(moe_dirs):
    """family -> (outputs, scheduler steps, routing per step) of one batched greedy run."""
    runs = {}
    for name, path in moe_dirs.items():
        llm = make_llm(path, kv_cache_page_size=4)
        steps, routing = record_steps(llm), record_routing(llm)
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
        runs[name] = (llm.generate(PROMPTS, params), steps, routing)
    return runs


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_and_logprobs_match_transformers(family, fw_runs, hf_refs):
    outputs, steps, _ = fw_runs[family]
    assert max(len(s) for s in steps) == len(PROMPTS), "the prompts did not share a batch"
    for out, (ids, ref_tokens, ref_logprobs) in zip(outputs, hf_refs[family]):
        got = out.outputs[0]
        assert out.prompt_token_ids == ids
        assert got.token_ids == ref_tokens, f"prompt {out.prompt!r}"
        for pos, (entry, ref) in enumerate(zip(got.logprobs, ref_logprobs)):
            assert set(entry) == set(torch.topk(ref, 2).indices.tolist()), pos
            for tid, lp in entry.items():
                assert abs(lp.logprob - ref[tid].item()) < TOL, (pos, tid)


@pytest.mark.parametrize("family", FAMILIES)
def test_tokens_of_one_batch_are_routed_to_different_experts(family, fw_runs):
    """The parity run above really exercised routing: in decode steps with all four sequences,
    the sequences' tokens chose different expert sets, and each layer used more than top-k experts."""
    _, steps, routing = fw_runs[family]
    top_k = SPECS[family].config["num_experts_per_tok"]
    decode_steps = [r for s, r in zip(steps, routing) if s == [1] * len(PROMPTS)]
    assert decode_steps
    differing = 0
    for layers in decode_steps:
        for ids in layers:
            assert ids.shape == (len(PROMPTS), top_k)
            differing += len({tuple(sorted(row.tolist())) for row in ids}) > 1
    assert differing >= len(decode_steps), "tokens of a batch nearly always chose the same experts"
    for layer in range(len(routing[0])):
        used = torch.cat([step[layer].flatten() for step in routing]).unique()
        assert len(used) > top_k


@pytest.mark.parametrize("family", FAMILIES)
def test_stacked_expert_checkpoint_loads_like_per_expert_names(family, moe_dirs, tokenizer, tmp_path):
    """transformers 5's in-memory layout (save_original_format=False: `mlp.experts.gate_up_proj`
    [E, 2I, H], Mixtral's `block_sparse_moe` renamed `mlp`) gives the same model as the hub names."""
    stacked = tiny_moe.build_model(SPECS[family], tokenizer, tmp_path / "stacked", save_original_format=False)
    names = set(load_file(stacked / "model.safetensors"))
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in names)
    assert not any(".experts.0." in n or "block_sparse_moe" in n for n in names)
    classic = set(load_file(moe_dirs[family] / "model.safetensors"))
    assert any(".experts.0." in n for n in classic)

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    a = make_llm(moe_dirs[family], num_kv_blocks=32).generate(PROMPTS[:2], params)
    b = make_llm(stacked, num_kv_blocks=32).generate(PROMPTS[:2], params)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for ex, ey in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert {t: lp.logprob for t, lp in ex.items()} == {t: lp.logprob for t, lp in ey.items()}


def test_incomplete_expert_checkpoint_is_a_clear_error(moe_dirs, tmp_path):
    src = moe_dirs["qwen2_moe"]
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.0.mlp.experts.3.up_proj.weight"]
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"lacks 1 expert tensors of model\.layers\.0\.mlp\.experts\."
                                             r"gate_up_proj, e\.g\. expert 3 \(up\)"):
        make_llm(broken, num_kv_blocks=8)


def layers(llm):
    return llm.engine.runner.model.model.layers


def test_layer_layout_follows_decoder_sparse_step_and_mlp_only_layers(moe_dirs, tokenizer, tmp_path):
    """Qwen2-MoE: layer 1 is in mlp_only_layers, so dense; with decoder_sparse_step=2 only odd layers
    (i + 1 even) are sparse, as transformers builds them."""
    llm = make_llm(moe_dirs["qwen2_moe"], num_kv_blocks=8)
    sparse = [any(isinstance(m, FusedExperts) for m in layer.modules()) for layer in layers(llm)]
    assert sparse == [True, False, True]

    hf = tiny_moe.make_hf_model(SPECS["qwen2_moe"], tokenizer, num_hidden_layers=4, decoder_sparse_step=2,
                                mlp_only_layers=[])
    path = tmp_path / "step2"
    hf.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    llm = make_llm(path, num_kv_blocks=8)
    sparse = [any(isinstance(m, FusedExperts) for m in layer.modules()) for layer in layers(llm)]
    assert sparse == [False, True, False, True]
    assert sparse == [type(layer.mlp).__name__ == "Qwen2MoeSparseMoeBlock" for layer in hf.model.layers]
    hf = tiny_moe.load_hf(SPECS["qwen2_moe"], path)
    ids = [1, 5, 9, 42, 7]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1], dim=-1)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1, logprobs=3))[0]
    for tid, lp in out.outputs[0].logprobs[0].items():
        assert abs(lp.logprob - ref[tid].item()) < TOL
