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
from fw.plugins import ArchitectureSpec, ModelConfig, MoeConfig, hookimpl

FW_PLUGIN_API_VERSION = "1.5"


class MixtralDecoderLayer(PreNormDecoderLayer):
    def __init__(self, cfg: ModelConfig, moe: MoeConfig, ctx: ModelContext, prefix: str):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, ctx.dtype)
        self.self_attn = SelfAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                       cfg.head_dim, ctx, f"{prefix}.self_attn", sliding_window=cfg.sliding_window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, ctx.dtype)
        self.mlp = SparseMoeBlock(cfg.hidden_size, moe.intermediate_size, moe.num_experts,
                                  moe.num_experts_per_tok, ctx, f"{prefix}.mlp", hidden_act=cfg.hidden_act,
                                  renormalize=True, weights_in_model_dtype=False)


class MixtralForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, ctx: ModelContext, max_positions: int | None = None):
        cfg = ModelConfig.from_hf(cfg).require("norm_eps", "hidden_act", "moe")
        moe = cfg.moe
        layers = (MixtralDecoderLayer(cfg, moe, ctx, f"model.layers.{i}") for i in range(cfg.num_hidden_layers))
        super().__init__(cfg, ctx, DecoderModel(cfg, ctx, max_positions or cfg.max_position_embeddings, layers))

    def load_checkpoint(self, weights: Iterable[tuple[str, torch.Tensor]], skip: tuple[str, ...]) -> set[str]:
        return load_moe_weights(self, weights, MIXTRAL_EXPERT_NAMES, fused=FUSED_PROJECTIONS, skip=skip,
                                renames=((".block_sparse_moe.", ".mlp."),))


def build(cfg: ModelConfig, ctx: ModelContext, max_positions: int | None = None) -> MixtralForCausalLM:
    return MixtralForCausalLM(cfg, ctx, max_positions)


@hookimpl
def fw_register_architectures(register) -> None:
    register(ArchitectureSpec(
        name="mixtral",
        hf_architectures=("MixtralForCausalLM",),
        build=build,
        build_config="model",
        description="Mixtral sparse Mixture of Experts (top-k SwiGLU experts, renormalised routing)",
    ))
