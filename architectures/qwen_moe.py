"""Qwen2-MoE and Qwen3-MoE: Qwen decoders whose MLP is a sparse Mixture of Experts.

Where they differ, as in transformers' modelling code:
- Qwen2-MoE: q/k/v biases (`qkv_bias`), a shared expert every token runs, scaled by
  sigmoid(shared_expert_gate(x)), and per-layer sliding windows from `layer_types`.
- Qwen3-MoE: per-head RMSNorm on q and k before rotary (QK-norm), `attention_bias` on all four
  projections, no shared expert.
- Both: routing weights renormalised over the top-k only with `norm_topk_prob`, then cast to the
  model dtype; layer i is sparse when i is not in `mlp_only_layers` and (i + 1) is a multiple of
  `decoder_sparse_step`, otherwise a dense SwiGLU MLP of `intermediate_size`.

Loads hub checkpoints (`mlp.experts.{e}.gate_proj/up_proj/down_proj`) and transformers 5's
stacked layout (`mlp.experts.gate_up_proj` / `down_proj`)."""

from __future__ import annotations

from typing import Iterable

import torch

from fw.layers import (FUSED_PROJECTIONS, GATED_EXPERT_NAMES, CausalLM, DecoderModel, GatedMLP, ModelContext,
                       PreNormDecoderLayer, RMSNorm, SelfAttention, SparseMoeBlock, load_moe_weights)
from fw.plugins import ArchitectureSpec, ModelConfig, hookimpl

FW_PLUGIN_API_VERSION = "1.5"


def _sliding_window(cfg: ModelConfig, i: int, qwen3: bool) -> int | None:
    if not cfg.use_sliding_window or not cfg.sliding_window:
        return None
    if qwen3:  # Qwen3-MoE windows every layer when enabled
        return cfg.sliding_window
    layer_types = cfg.layer_types
    return cfg.sliding_window if layer_types and layer_types[i] == "sliding_attention" else None


class QwenMoeDecoderLayer(PreNormDecoderLayer):
    def __init__(self, cfg: ModelConfig, ctx: ModelContext, i: int, qwen3: bool):
        super().__init__()
        prefix = f"model.layers.{i}"
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, ctx.dtype)
        if qwen3:
            bias = cfg.attention_bias
            attn_options = {"qkv_bias": bias, "o_bias": bias, "qk_norm_eps": cfg.norm_eps}
        else:  # configs written before transformers 5 have no `qkv_bias`: Qwen2 always had q/k/v biases
            attn_options = {"qkv_bias": True if cfg.qkv_bias is None else cfg.qkv_bias}
        self.self_attn = SelfAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                       cfg.head_dim, ctx, f"{prefix}.self_attn",
                                       sliding_window=_sliding_window(cfg, i, qwen3), **attn_options)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, ctx.dtype)
        if cfg.moe is not None and cfg.moe.is_sparse(i):
            moe = cfg.moe
            shared = None if qwen3 else moe.shared_expert_intermediate_size
            self.mlp = SparseMoeBlock(cfg.hidden_size, moe.intermediate_size, moe.num_experts,
                                      moe.num_experts_per_tok, ctx, f"{prefix}.mlp", hidden_act=cfg.hidden_act,
                                      renormalize=moe.norm_topk_prob, weights_in_model_dtype=True,
                                      shared_expert_intermediate_size=shared, shared_expert_gate=bool(shared))
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, ctx, f"{prefix}.mlp",
                                hidden_act=cfg.hidden_act)


class QwenMoeForCausalLM(CausalLM):
    """Qwen2MoeForCausalLM (`qwen3=False`) and Qwen3MoeForCausalLM (`qwen3=True`)."""

    def __init__(self, cfg: ModelConfig, ctx: ModelContext, max_positions: int | None = None, qwen3: bool = False):
        cfg = ModelConfig.from_hf(cfg).require("norm_eps", "hidden_act")
        layers = (QwenMoeDecoderLayer(cfg, ctx, i, qwen3) for i in range(cfg.num_hidden_layers))
        super().__init__(cfg, ctx, DecoderModel(cfg, ctx, max_positions or cfg.max_position_embeddings, layers))

    def load_checkpoint(self, weights: Iterable[tuple[str, torch.Tensor]], skip: tuple[str, ...]) -> set[str]:
        return load_moe_weights(self, weights, GATED_EXPERT_NAMES, fused=FUSED_PROJECTIONS, skip=skip)


def build_qwen2_moe(cfg: ModelConfig, ctx: ModelContext, max_positions: int | None = None) -> QwenMoeForCausalLM:
    return QwenMoeForCausalLM(cfg, ctx, max_positions, qwen3=False)


def build_qwen3_moe(cfg: ModelConfig, ctx: ModelContext, max_positions: int | None = None) -> QwenMoeForCausalLM:
    return QwenMoeForCausalLM(cfg, ctx, max_positions, qwen3=True)


@hookimpl
def fw_register_architectures(register) -> None:
    register(ArchitectureSpec(
        name="qwen2_moe",
        hf_architectures=("Qwen2MoeForCausalLM",),
        build=build_qwen2_moe,
        build_config="model",
        description="Qwen2-MoE / Qwen1.5-MoE: top-k experts plus a sigmoid-gated shared expert",
    ))
    register(ArchitectureSpec(
        name="qwen3_moe",
        hf_architectures=("Qwen3MoeForCausalLM",),
        build=build_qwen3_moe,
        build_config="model",
        description="Qwen3-MoE: top-k experts, QK-norm",
    ))
