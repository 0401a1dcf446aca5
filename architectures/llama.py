"""Llama family: Llama 2/3.x, SmolLM/SmolLM2, TinyLlama, Mistral (with its sliding window).

Built from fw's shared layers: fused QKV and gate/up linears (delegating to the
quantization method), RMSNorm, rotary embedding (every HF rope type), and the
selected attention backend over the paged KV cache."""

from __future__ import annotations


import torch
from torch import nn

from fw.layers import (CausalLM, GatedMLP, ModelContext, RMSNorm, RotaryEmbedding, SelfAttention)
from fw.plugins import ArchitectureSpec, hookimpl

FW_PLUGIN_API_VERSION = "1.0"


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg, ctx: ModelContext, prefix: str):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        bias = getattr(cfg, "attention_bias", False)
        self.self_attn = SelfAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim,
                                       ctx, f"{prefix}.self_attn", qkv_bias=bias, o_bias=bias,
                                       sliding_window=getattr(cfg, "sliding_window", None))  # Mistral: every layer
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)
        if cfg.hidden_act != "silu":
            raise ValueError(f"Llama MLP supports hidden_act 'silu', not {cfg.hidden_act!r}")
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, ctx, f"{prefix}.mlp",
                            bias=getattr(cfg, "mlp_bias", False))

    def forward(self, x, residual, cos_sin, meta):
        if residual is None:
            residual = x
            x = self.input_layernorm.forward(x)
        else:
            x, residual = self.input_layernorm.forward(x, residual)
        x = self.self_attn.forward(x, cos_sin, meta)
        x, residual = self.post_attention_layernorm.forward(x, residual)
        return self.mlp.forward(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg, ctx: ModelContext, max_positions: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=ctx.dtype)
        self.embed_tokens.weight.requires_grad_(False)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.rotary = RotaryEmbedding(cfg, head_dim, max_positions, ctx.dtype)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, ctx, f"model.layers.{i}") for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)

    def forward(self, input_ids, positions, meta):
        x, residual = self.embed_tokens(input_ids), None
        cos_sin = self.rotary(positions)
        for layer in self.layers:
            x, residual = layer.forward(x, residual, cos_sin, meta)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(CausalLM):
    def __init__(self, cfg, ctx: ModelContext, max_positions: int | None = None):
        super().__init__(cfg, ctx, LlamaModel(cfg, ctx, max_positions or cfg.max_position_embeddings))


def unpermute_gguf_qk(name: str, tensor: torch.Tensor, cfg) -> torch.Tensor:
    """llama.cpp stores Q/K rows interleaved for its rope; restore HF's rotate-half order."""
    if name.endswith("q_proj.weight"):
        heads = cfg.num_attention_heads
    elif name.endswith("k_proj.weight"):
        heads = cfg.num_key_value_heads
    else:
        return tensor
    rows = tensor.shape[0]
    return tensor.reshape(heads, rows // heads // 2, 2, *tensor.shape[1:]).transpose(1, 2).reshape(tensor.shape)


def build(cfg, ctx: ModelContext, max_positions: int | None = None) -> LlamaForCausalLM:
    return LlamaForCausalLM(cfg, ctx, max_positions)


@hookimpl
def fw_register_architectures(register) -> None:
    register(ArchitectureSpec(
        name="llama",
        # Mistral is Llama plus a sliding window in every layer; its config states the window,
        # and a backend that cannot apply it rejects the model with that reason.
        hf_architectures=("LlamaForCausalLM", "MistralForCausalLM"),
        gguf_architectures=("llama",),
        build=build,
        gguf_weight_transform=unpermute_gguf_qk,
        description="Llama 2/3.x, SmolLM/SmolLM2, TinyLlama, Mistral (sliding window)",
    ))
