"""Gemma, Gemma 2 and Gemma 3 (text): Llama-shaped decoders with Gemma's numerics.

Common to all three: GeGLU MLP (gelu, tanh approximation), RMSNorm scaling by
(1 + weight), embeddings multiplied by sqrt(hidden_size) rounded to the model
dtype (as transformers does), tied input/output embeddings.
Gemma 2 adds `query_pre_attn_scalar` as the softmax scale, norms after the
attention and around the MLP ("sandwich"), attention-logit and final-logit
soft-capping, and interleaved sliding-window / global layers
(`config.layer_types`). Gemma 3 keeps that layout, normalises q and k per head,
and gives each layer type its own rotary embedding (`rope_parameters` keyed by
layer type: a local base for sliding layers, the global base with its scaling
for full ones). Gemma 3's config may carry `attn_logit_softcapping`, but
transformers' Gemma 3 does not apply it, so neither does fw."""

from __future__ import annotations

import torch
from torch import nn

from fw.errors import ModelLoadError
from fw.layers import (CausalLM, GatedMLP, ModelContext, RMSNorm, RotaryEmbedding, SelfAttention)
from fw.plugins import ArchitectureSpec, ModelConfig, hookimpl

FW_PLUGIN_API_VERSION = "1.5"


def gemma_norm(hidden_size: int, eps: float, dtype: torch.dtype) -> RMSNorm:
    """Gemma stores (scale - 1): fw's RMSNorm with weight_offset 1 scales by (1 + weight) in fp32
    and rounds once, Gemma's numerics."""
    return RMSNorm(hidden_size, eps, dtype, weight_offset=1.0)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ModelContext, prefix: str, version: int, layer_type: str):
        super().__init__()
        hidden, eps, head_dim = cfg.hidden_size, cfg.norm_eps, cfg.head_dim
        self.layer_type = layer_type
        self.sandwich = version >= 2
        sliding = layer_type == "sliding_attention"
        bias = cfg.attention_bias
        self.input_layernorm = gemma_norm(hidden, eps, ctx.dtype)
        self.self_attn = SelfAttention(
            hidden, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim, ctx, f"{prefix}.self_attn",
            qkv_bias=bias, o_bias=bias,
            scale=cfg.require("query_pre_attn_scalar").query_pre_attn_scalar ** -0.5 if version >= 2 else None,
            sliding_window=cfg.sliding_window if sliding else None,
            logit_softcap=cfg.attn_logit_softcapping if version == 2 else None,
            qk_norm_eps=eps if version >= 3 else None, qk_norm_weight_offset=1.0,  # Gemma 3: per-head QK norm
        )
        self.post_attention_layernorm = gemma_norm(hidden, eps, ctx.dtype)
        if self.sandwich:
            self.pre_feedforward_layernorm = gemma_norm(hidden, eps, ctx.dtype)
            self.post_feedforward_layernorm = gemma_norm(hidden, eps, ctx.dtype)
        self.mlp = GatedMLP(hidden, cfg.intermediate_size, ctx, f"{prefix}.mlp", hidden_act=cfg.hidden_act)

    def forward(self, x, residual, cos_sin, meta):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos_sin, meta)
        if not self.sandwich:  # Gemma: post_attention_layernorm is the MLP's pre-norm
            x, residual = self.post_attention_layernorm(x, residual)
            return self.mlp(x), residual
        x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(x), residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


def _layer_types(cfg: ModelConfig, version: int) -> list[str]:
    if version == 1:
        return ["full_attention"] * cfg.num_hidden_layers
    return list(cfg.layer_types_checked(("sliding_attention", "full_attention")))


class GemmaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ModelContext, max_positions: int, version: int):
        super().__init__()
        if cfg.use_bidirectional_attention:
            raise ModelLoadError("this Gemma config sets use_bidirectional_attention (an embedding model); "
                                 "fw generates text with causal attention only")
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=ctx.dtype)
        self.embed_tokens.weight.requires_grad_(False)
        # sqrt(hidden) rounded to the model dtype first, as transformers does (55.4256 -> 55.5 in bf16)
        normalizer = torch.tensor(cfg.hidden_size ** 0.5, dtype=torch.float32).to(ctx.dtype)
        self.register_buffer("normalizer", normalizer, persistent=False)
        types = _layer_types(cfg, version)
        if version >= 3:  # one rotary embedding per layer type
            ropes = {t: RotaryEmbedding(cfg.rope_for(t), cfg.head_dim, max_positions, ctx.dtype) for t in set(types)}
        else:
            ropes = {"all": RotaryEmbedding(cfg, cfg.head_dim, max_positions, ctx.dtype)}
        self.rotary = nn.ModuleDict(ropes)
        self.rope_keys = [t if version >= 3 else "all" for t in types]
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(cfg, ctx, f"model.layers.{i}", version, t) for i, t in enumerate(types)
        )
        self.norm = gemma_norm(cfg.hidden_size, cfg.norm_eps, ctx.dtype)

    def forward(self, input_ids, positions, meta):
        x, residual = self.embed_tokens(input_ids) * self.normalizer, None
        cos_sin = {key: rope(positions) for key, rope in self.rotary.items()}
        for layer, key in zip(self.layers, self.rope_keys):
            x, residual = layer(x, residual, cos_sin[key], meta)
        x, _ = self.norm(x, residual)
        return x


class GemmaForCausalLM(CausalLM):
    skip_weights = ("rotary_emb.",)

    def __init__(self, cfg: ModelConfig, ctx: ModelContext, max_positions: int | None = None, version: int = 1):
        cfg = ModelConfig.from_hf(cfg).require("norm_eps", "intermediate_size", "hidden_act")
        super().__init__(cfg, ctx, GemmaModel(cfg, ctx, max_positions or cfg.max_position_embeddings, version),
                         tie_by_default=True)
        self.final_softcap = cfg.final_logit_softcapping if version >= 2 else None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.final_softcap:  # in the model dtype, as transformers does
            cap = self.final_softcap
            logits = logits.to(hidden.dtype)
            logits = torch.tanh(logits / cap) * cap
        return logits


def build_gemma(cfg: ModelConfig, ctx: ModelContext, max_positions: int | None = None) -> GemmaForCausalLM:
    return GemmaForCausalLM(cfg, ctx, max_positions, version=1)


def build_gemma2(cfg: ModelConfig, ctx: ModelContext, max_positions: int | None = None) -> GemmaForCausalLM:
    return GemmaForCausalLM(cfg, ctx, max_positions, version=2)


def build_gemma3(cfg: ModelConfig, ctx: ModelContext, max_positions: int | None = None) -> GemmaForCausalLM:
    return GemmaForCausalLM(cfg, ctx, max_positions, version=3)


@hookimpl
def fw_register_architectures(register) -> None:
    register(ArchitectureSpec(
        name="gemma",
        hf_architectures=("GemmaForCausalLM",),
        build=build_gemma,
        build_config="model",
        description="Gemma (GeGLU, (1 + w) RMSNorm, sqrt(hidden) embedding scale, tied embeddings)",
    ))
    register(ArchitectureSpec(
        name="gemma2",
        hf_architectures=("Gemma2ForCausalLM",),
        build=build_gemma2,
        build_config="model",
        description="Gemma 2 (interleaved sliding-window/global layers, attention and final logit soft-capping)",
    ))
    register(ArchitectureSpec(
        name="gemma3",
        hf_architectures=("Gemma3ForCausalLM",),
        build=build_gemma3,
        build_config="model",
        description="Gemma 3 text (sliding/global layers with their own rope bases, QK-norm, final soft-capping)",
    ))
