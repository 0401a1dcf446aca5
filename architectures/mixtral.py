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

from fw.layers import (FUSED_PROJECTIONS, MIXTRAL_EXPERT_NAMES, Linear, ModelContext, RMSNorm, RotaryEmbedding,
                       SelfAttention, SparseMoeBlock, dense_linear, load_moe_weights, pack_dense_weight)
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


class MixtralForCausalLM(nn.Module):
    def __init__(self, cfg, ctx: ModelContext, max_positions: int | None = None):
        super().__init__()
        self.config = cfg
        self.model = MixtralModel(cfg, ctx, max_positions or cfg.max_position_embeddings)
        self.tie = bool(getattr(cfg, "tie_word_embeddings", False))
        if not self.tie:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, ctx, "lm_head")
        self.device = ctx.device
        self.tied_head: torch.Tensor | None = None

    def forward(self, input_ids, positions, meta) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.tie:
            head = self.tied_head if self.tied_head is not None else self.model.embed_tokens.weight
            return dense_linear(hidden, head)
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        skip = ("rotary_emb.inv_freq",) + (("lm_head.",) if self.tie else ())
        loaded = load_moe_weights(self, weights, MIXTRAL_EXPERT_NAMES, fused=FUSED_PROJECTIONS, skip=skip,
                                  renames=((".block_sparse_moe.", ".mlp."),))
        if self.tie:
            packed = pack_dense_weight(self.model.embed_tokens.weight.data, self.device)
            self.tied_head = packed if packed.is_mkldnn else None
        return loaded


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
