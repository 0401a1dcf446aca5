"""Qwen2 and Qwen3 (dense): a Llama-shaped decoder where the attention differs.

Qwen2 has biases on the q/k/v projections (not on o_proj) and may slide a
window over the layers from `max_window_layers` on when `use_sliding_window`
is set; transformers 5 states the result per layer in `config.layer_types`,
which is what this file reads. Qwen3 drops the biases (unless
`attention_bias`), normalises q and k per head (RMSNorm before rotary), and
states `head_dim` explicitly (it need not be hidden_size / heads)."""

from __future__ import annotations


from torch import nn

from fw.errors import ModelLoadError
from fw.layers import (CausalLM, GatedMLP, ModelContext, RMSNorm, RotaryEmbedding, SelfAttention)
from fw.plugins import ArchitectureSpec, hookimpl

FW_PLUGIN_API_VERSION = "1.0"


def layer_window(cfg, index: int) -> int | None:
    """Layer `index`'s sliding window as transformers decides it (None: full attention). Its config
    class fills `layer_types` from use_sliding_window / max_window_layers and clears
    `sliding_window` when use_sliding_window is false."""
    if len(cfg.layer_types) != cfg.num_hidden_layers:
        raise ModelLoadError(f"config.json: layer_types lists {len(cfg.layer_types)} layers, the model has "
                             f"{cfg.num_hidden_layers}")
    return cfg.sliding_window if cfg.layer_types[index] == "sliding_attention" else None


class QwenDecoderLayer(nn.Module):
    def __init__(self, cfg, ctx: ModelContext, prefix: str, index: int, qwen3: bool):
        super().__init__()
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        if qwen3:
            bias = bool(getattr(cfg, "attention_bias", False))
            options = dict(qkv_bias=bias, o_bias=bias, qk_norm_eps=cfg.rms_norm_eps)
        else:
            options = dict(qkv_bias=True, o_bias=False)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)
        self.self_attn = SelfAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim,
                                       ctx, f"{prefix}.self_attn", sliding_window=layer_window(cfg, index), **options)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, ctx, f"{prefix}.mlp", hidden_act=cfg.hidden_act)

    def forward(self, x, residual, cos_sin, meta):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos_sin, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class QwenModel(nn.Module):
    def __init__(self, cfg, ctx: ModelContext, max_positions: int, qwen3: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=ctx.dtype)
        self.embed_tokens.weight.requires_grad_(False)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.rotary = RotaryEmbedding(cfg, head_dim, max_positions, ctx.dtype)
        self.layers = nn.ModuleList(
            QwenDecoderLayer(cfg, ctx, f"model.layers.{i}", i, qwen3) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)

    def forward(self, input_ids, positions, meta):
        x, residual = self.embed_tokens(input_ids), None
        cos_sin = self.rotary(positions)
        for layer in self.layers:
            x, residual = layer(x, residual, cos_sin, meta)
        x, _ = self.norm(x, residual)
        return x


class QwenForCausalLM(CausalLM):
    def __init__(self, cfg, ctx: ModelContext, max_positions: int | None = None, qwen3: bool = False):
        super().__init__(cfg, ctx, QwenModel(cfg, ctx, max_positions or cfg.max_position_embeddings, qwen3))


def build_qwen2(cfg, ctx: ModelContext, max_positions: int | None = None) -> QwenForCausalLM:
    return QwenForCausalLM(cfg, ctx, max_positions, qwen3=False)


def build_qwen3(cfg, ctx: ModelContext, max_positions: int | None = None) -> QwenForCausalLM:
    return QwenForCausalLM(cfg, ctx, max_positions, qwen3=True)


@hookimpl
def fw_register_architectures(register) -> None:
    register(ArchitectureSpec(
        name="qwen2",
        hf_architectures=("Qwen2ForCausalLM",),
        build=build_qwen2,
        description="Qwen2 / Qwen2.5 (q/k/v biases; sliding window from max_window_layers when enabled)",
    ))
    register(ArchitectureSpec(
        name="qwen3",
        hf_architectures=("Qwen3ForCausalLM",),
        build=build_qwen3,
        description="Qwen3 dense (per-head QK RMSNorm, explicit head_dim)",
    ))
