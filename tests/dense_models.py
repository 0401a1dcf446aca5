"""Tiny random-weight checkpoints of the dense families beyond Llama (Gemma, Gemma 2,
Gemma 3, Qwen2, Qwen3, Mistral), made offline from transformers' config classes, with
the shared offline tokenizer, and their transformers twins as the oracle.

Shapes are small but keep what each family is about: GQA, a sliding window (8) shorter
than the prompts, interleaved sliding/global layers, soft-capping values that bite on
these weights (attention 5.0, final 10.0), QK-norm, an explicit head_dim unequal to
hidden / heads, Qwen2's biases (randomised, so they matter)."""

from __future__ import annotations

from pathlib import Path

import torch

WINDOW = 8

# name -> (config class name, model class name, config overrides)
SPECS: dict[str, tuple[str, str, dict]] = {
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=4, head_dim=16, num_hidden_layers=2)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=4,
        query_pre_attn_scalar=24, sliding_window=WINDOW, attn_logit_softcapping=5.0, final_logit_softcapping=10.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=4,
        query_pre_attn_scalar=24, sliding_window=WINDOW, final_logit_softcapping=10.0,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
        use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_hidden_layers=2)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=2, sliding_window=WINDOW)),
}

# Gemma keeps RMSNorm weights as (scale - 1).
_GEMMA = ("gemma", "gemma2", "gemma3")
# Norms after attention and MLP: with HF-like weights these models repeat one token; the
# weights below (found by trying) give 16-30 distinct tokens in 32.
_SANDWICH = ("gemma2", "gemma3")


def _classes(name: str):
    import transformers

    config_cls, model_cls, _ = SPECS[name]
    return getattr(transformers, config_cls), getattr(transformers, model_cls)


def make_config(name: str, tokenizer, **overrides):
    config_cls, _ = _classes(name)
    options = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, max_position_embeddings=256,
                   rms_norm_eps=1e-6, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=name in _GEMMA)
    options.update(SPECS[name][2])
    options.update(overrides)
    return config_cls(**options)


def build(name: str, tokenizer, path: Path, seed: int = 7, **overrides) -> Path:
    """Save a random-weight model of family `name` plus the tokenizer into `path`.

    HF's initialisation (std 0.02, zero biases, unit norms) makes a model that repeats one
    token; wider weights, noisy norms and biases, and a large final-norm scale give varied,
    peaked greedy text, so the comparison is not decided by rounding noise."""
    config = make_config(name, tokenizer, **overrides)
    _, model_cls = _classes(name)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    sandwich = name in _SANDWICH
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 2:
                std = 0.1 if "embed" in pname or "lm_head" in pname else 0.3
                p.normal_(0.0, 0.5 if sandwich and (".q_proj" in pname or ".k_proj" in pname) else std)
            elif pname.endswith("bias"):
                p.normal_(0.0, 0.5)
            else:  # norm weights
                p.add_(torch.randn_like(p) * 0.1)
                if sandwich and any(n in pname for n in ("post_", "q_norm", "k_norm")):
                    p.add_(2.0)  # scale 3: layer outputs and sharper attention drive the text
        model.model.norm.weight.fill_(3.0 if name in _GEMMA else 4.0)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def load_hf(name: str, path: Path):
    """transformers' own model on the checkpoint: fp32, eager attention, never stopping at EOS."""
    _, model_cls = _classes(name)
    model = model_cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model.generation_config.eos_token_id = None
    return model.eval()
