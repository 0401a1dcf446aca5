"""An architecture built only from fw's shared layers (`fw.layers`).

It reads Hugging Face Llama checkpoints (same tensor names) whose config.json
names ``"architectures": ["ExampleLlamaForCausalLM"]``. With the config key
``parallel_residual: true`` each block computes attention and MLP from the same
input and adds both to the residual stream (GPT-J / PaLM style), a common
research variant; without it the model is exactly Llama, which is what lets the
plugin's tests compare it token for token with transformers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fw.layers import Attention, CausalLM, Linear, ModelContext, RMSNorm, RotaryEmbedding, apply_rotary


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class SelfAttention(nn.Module):
    def __init__(self, cfg, ctx: ModelContext, prefix: str):
        super().__init__()
        self.head_dim = _head_dim(cfg)
        self.q_size = cfg.num_attention_heads * self.head_dim
        self.kv_size = cfg.num_key_value_heads * self.head_dim
        bias = bool(getattr(cfg, "attention_bias", False))
        # q, k and v load into one fused matmul; `Linear` fills each shard from its own checkpoint tensor.
        self.qkv_proj = Linear(cfg.hidden_size, [self.q_size, self.kv_size, self.kv_size], ctx,
                               f"{prefix}.qkv_proj", bias=bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, ctx, f"{prefix}.o_proj", bias=bias)
        self.attn = Attention(cfg.num_attention_heads, cfg.num_key_value_heads, self.head_dim, ctx)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], meta) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = apply_rotary(q, k, cos_sin, self.head_dim)
        return self.o_proj(self.attn(q, k, v, meta))


class GatedMLP(nn.Module):
    def __init__(self, cfg, ctx: ModelContext, prefix: str):
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ValueError(f"example-llama supports hidden_act 'silu', not {cfg.hidden_act!r}")
        self.inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, [self.inter, self.inter], ctx, f"{prefix}.gate_up_proj")
        self.down_proj = Linear(self.inter, cfg.hidden_size, ctx, f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg, ctx: ModelContext, prefix: str, parallel: bool):
        super().__init__()
        self.parallel = parallel
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)
        self.self_attn = SelfAttention(cfg, ctx, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)
        self.mlp = GatedMLP(cfg, ctx, f"{prefix}.mlp")

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], meta) -> torch.Tensor:
        if self.parallel:  # both branches read the block input
            return x + self.self_attn(self.input_layernorm(x), cos_sin, meta) + self.mlp(
                self.post_attention_layernorm(x))
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class ExampleModel(nn.Module):
    def __init__(self, cfg, ctx: ModelContext, max_positions: int):
        super().__init__()
        parallel = bool(getattr(cfg, "parallel_residual", False))
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=ctx.dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.rotary = RotaryEmbedding(cfg, _head_dim(cfg), max_positions, ctx.dtype)
        self.layers = nn.ModuleList(
            Block(cfg, ctx, f"model.layers.{i}", parallel) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos_sin = self.rotary(positions)  # once per step, shared by every layer
        for layer in self.layers:
            x = layer(x, cos_sin, meta)
        return self.norm(x)


class ExampleLlamaForCausalLM(CausalLM):
    """fw's engine calls forward, compute_logits and load_weights; fw.layers.CausalLM provides them around
    `model` (output projection, tied or not, and checkpoint loading into the fused projections)."""

    def __init__(self, cfg, ctx: ModelContext, max_positions: int | None = None):
        super().__init__(cfg, ctx, ExampleModel(cfg, ctx, max_positions or cfg.max_position_embeddings))


def build(cfg, ctx: ModelContext, max_positions: int | None = None) -> ExampleLlamaForCausalLM:
    return ExampleLlamaForCausalLM(cfg, ctx, max_positions)
