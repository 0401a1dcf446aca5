"""Llama-family variants the `llama` plugin covers, each against transformers:
Llama 3's rope scaling, linear rope scaling, and Mistral without a sliding window.
A Mistral with a window runs it in every layer (on cpu_paged by default); tests/test_arch_dense.py
checks it against transformers on both backends."""

from __future__ import annotations

import pytest
import torch

from conftest import make_llm
from fw import SamplingParams
from fw.layers.rotary import rope_inv_freq

ROPES = {
    # Small original context so the scaled frequencies differ from the default ones.
    "llama3": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
}


def _save(model_cls, config, tokenizer, path):
    torch.manual_seed(3)
    model = model_cls(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
        model.model.norm.weight.fill_(4.0)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return model.eval()


def _compare(path, hf, tokenizer) -> None:
    prompts = ["Once upon a time, in a small village by the river", "one two three four five six seven eight nine"]
    outs = make_llm(path).generate(prompts, SamplingParams(max_tokens=16, temperature=0, logprobs=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ids = tokenizer(prompt).input_ids
        got = out.outputs[0]
        with torch.no_grad():
            logits = hf(torch.tensor([ids + got.token_ids])).logits[0].float().log_softmax(-1)
        expected = logits[len(ids) - 1: -1].argmax(-1).tolist()
        assert got.token_ids == expected
        diffs = [abs(got.logprobs[i][t].logprob - logits[len(ids) - 1 + i, t].item()) for i, t in enumerate(expected)]
        assert max(diffs) < 1e-3


def _common(tokenizer) -> dict:
    return dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)


@pytest.mark.parametrize("rope", sorted(ROPES))
def test_rope_scaling_matches_transformers(rope, tokenizer, tmp_path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**_common(tokenizer), rope_parameters=dict(ROPES[rope]))
    scaled, _ = rope_inv_freq(config, 16)
    default, _ = rope_inv_freq(LlamaConfig(**_common(tokenizer)), 16)
    assert not torch.allclose(scaled, default)  # the case really exercises the scaling
    hf = _save(LlamaForCausalLM, config, tokenizer, tmp_path)
    _compare(tmp_path, hf, tokenizer)


def test_mistral_without_sliding_window_matches_transformers(tokenizer, tmp_path) -> None:
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(**_common(tokenizer), sliding_window=None)
    hf = _save(MistralForCausalLM, config, tokenizer, tmp_path)
    assert make_llm(tmp_path).engine.loaded.architecture.name == "llama"
    _compare(tmp_path, hf, tokenizer)


def test_mistral_with_sliding_window_runs_its_window_on_every_layer(tokenizer, tmp_path) -> None:
    from transformers import MistralConfig, MistralForCausalLM

    _save(MistralForCausalLM, MistralConfig(**_common(tokenizer), sliding_window=32), tokenizer, tmp_path)
    loaded = make_llm(tmp_path).engine.loaded
    assert loaded.attention.chosen.name == "cpu_paged"
    windows = {m.impl.sliding_window for m in loaded.model.modules() if hasattr(m, "impl")}
    assert windows == {32}
