"""Tiny random-weight Mixture-of-Experts checkpoints (Mixtral, Qwen2-MoE, Qwen3-MoE) made from
transformers' config classes, and their transformers twins as the numerical oracle. No network.

Weights are drawn wider than transformers' init (as in tiny_models), so routing is peaked and
varied (tokens of one batch pick different experts) and greedy text does not hinge on rounding."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from tiny_models import VOCAB_SIZE


@dataclass(frozen=True)
class MoeSpec:
    name: str
    config_cls: str
    model_cls: str
    config: dict = field(default_factory=dict)
    seed: int = 0


# One GQA shape (Mixtral, Qwen3-MoE), one MHA (Qwen2-MoE); renormalised routing (Mixtral always,
# Qwen3-MoE by norm_topk_prob) and not (Qwen2-MoE); a dense layer among sparse ones (Qwen2-MoE's
# mlp_only_layers); a tied head (Qwen3-MoE).
MIXTRAL = MoeSpec("mixtral", "MixtralConfig", "MixtralForCausalLM", dict(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=48,
    num_local_experts=8, num_experts_per_tok=2, rope_theta=10000.0, tie_word_embeddings=False), seed=11)
QWEN2_MOE = MoeSpec("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=3, intermediate_size=96,
    moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=6, num_experts_per_tok=2,
    norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1], qkv_bias=True, rope_theta=10000.0,
    tie_word_embeddings=False), seed=12)
QWEN3_MOE = MoeSpec("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=2,
    intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
    decoder_sparse_step=1, rope_theta=1000000.0, tie_word_embeddings=True), seed=13)
SPECS = (MIXTRAL, QWEN2_MOE, QWEN3_MOE)


def make_hf_model(spec: MoeSpec, tokenizer, **overrides):
    """transformers' model of `spec` with wide random weights, fp32, eager attention and experts."""
    import transformers

    config = getattr(transformers, spec.config_cls)(
        vocab_size=VOCAB_SIZE, max_position_embeddings=512, rms_norm_eps=1e-6,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        architectures=[spec.model_cls], **{**spec.config, **overrides})
    torch.manual_seed(spec.seed)
    model = getattr(transformers, spec.model_cls)(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.1 if "embed" in name or "lm_head" in name else 0.3)
            elif "bias" in name:
                p.normal_(0.0, 0.1)
        model.model.norm.weight.fill_(4.0)
    return model


def build_model(spec: MoeSpec, tokenizer, path: Path, save_original_format: bool = True) -> Path:
    """Save `spec`'s random model plus the tokenizer into `path`. `save_original_format=False`
    writes transformers 5's stacked expert tensors instead of the per-expert hub names."""
    model = make_hf_model(spec, tokenizer)
    model.save_pretrained(path, safe_serialization=True, save_original_format=save_original_format)
    tokenizer.save_pretrained(path)
    return path


def load_hf(spec: MoeSpec, path: Path):
    """The reference: transformers' own model on the same checkpoint, fp32, eager attention and the
    eager (per-expert loop) experts implementation, i.e. the modelling code as written."""
    import transformers

    model = getattr(transformers, spec.model_cls).from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager")
    model.generation_config.eos_token_id = None  # parity runs need the full length
    return model.eval()
