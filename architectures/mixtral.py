"""Mixtral: a Mistral-shaped decoder whose MLP is a sparse Mixture of Experts (top-k of
`num_local_experts` SwiGLU experts per token, routing weights renormalised over the top-k and
kept in float32, as transformers does).

Built from fw's shared layers: `SelfAttention` (fused QKV, rotary, optional sliding window),
`SparseMoeBlock` (router + stacked experts, computed by the selected MoE kernel), RMSNorm.
Loads hub checkpoints (`block_sparse_moe.experts.{e}.w1/w2/w3`) and transformers 5's stacked
layout (`mlp.experts.gate_up_proj` / `down_proj`)."""

from __future__ import annotations

from typing import Iterable

import torch

from fw.layers import (FUSED_PROJECTIONS, MIXTRAL_EXPERT_NAMES, CausalLM, DecoderModel, ModelContext,
                       PreNormDecoderLayer, RMSNorm, SelfAttention, SparseMoeBlock, load_moe_weights)
from fw.plugins import ArchitectureSpec, hookimpl

FW_PLUGIN_API_VERSION = "1.0"


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class MixtralDecoderLayer(PreNormDecoderLayer):
    def __init__(self, cfg, ctx: ModelContext, prefix: str):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)
        self.self_attn = SelfAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                       _head_dim(cfg), ctx, f"{prefix}.self_attn",
                                       sliding_window=getattr(cfg, "sliding_window", None) or None)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)
        self.mlp = SparseMoeBlock(cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts,
                                  cfg.num_experts_per_tok, ctx, f"{prefix}.mlp", hidden_act=cfg.hidden_act,
                                  renormalize=True, weights_in_model_dtype=False)


class MixtralForCausalLM(CausalLM):
    def __init__(self, cfg, ctx: ModelContext, max_positions: int | None = None):
        layers = (MixtralDecoderLayer(cfg, ctx, f"model.layers.{i}") for i in range(cfg.num_hidden_layers))
        super().__init__(cfg, ctx, DecoderModel(cfg, ctx, max_positions or cfg.max_position_embeddings, layers,
                                                _head_dim(cfg)))

    def load_checkpoint(self, weights: Iterable[tuple[str, torch.Tensor]], skip: tuple[str, ...]) -> set[str]:
        return load_moe_weights(self, weights, MIXTRAL_EXPERT_NAMES, fused=FUSED_PROJECTIONS, skip=skip,
                                renames=((".block_sparse_moe.", ".mlp."),))


def build(cfg, ctx: ModelContext, max_positions: int | None = None) -> MixtralForCausalLM:
    return MixtralForCausalLM(cfg, ctx, max_positions)


@hookimpl
def fw_register_architectures(register) -> None:
    register(ArchitectureSpec(
        name="mixtral",
        hf_architectures=("MixtralForCausalLM",),
        build=build,
        description="Mixtral sparse Mixture of Experts (top-k SwiGLU experts, renormalised routing)",
    ))
