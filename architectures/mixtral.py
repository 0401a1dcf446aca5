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
from torch import nn

from fw.layers import (CausalLM, FUSED_PROJECTIONS, MIXTRAL_EXPERT_NAMES, ModelContext, RMSNorm, RotaryEmbedding,
                       SelfAttention, SparseMoeBlock, load_moe_weights)
from fw.plugins import ArchitectureSpec, hookimpl

FW_PLUGIN_API_VERSION = "1.0"


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class MixtralDecoderLayer(nn.Module):
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

    def forward(self, x, residual, cos_sin, meta):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos_sin, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class MixtralModel(nn.Module):
    def __init__(self, cfg, ctx: ModelContext, max_positions: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=ctx.dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.rotary = RotaryEmbedding(cfg, _head_dim(cfg), max_positions, ctx.dtype)
        self.layers = nn.ModuleList(
            MixtralDecoderLayer(cfg, ctx, f"model.layers.{i}") for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)

    def forward(self, input_ids, positions, meta):
        x, residual = self.embed_tokens(input_ids), None
        cos_sin = self.rotary(positions)
        for layer in self.layers:
            x, residual = layer(x, residual, cos_sin, meta)
        x, _ = self.norm(x, residual)
        return x


class MixtralForCausalLM(CausalLM):
    def __init__(self, cfg, ctx: ModelContext, max_positions: int | None = None):
        super().__init__(cfg, ctx, MixtralModel(cfg, ctx, max_positions or cfg.max_position_embeddings))

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
