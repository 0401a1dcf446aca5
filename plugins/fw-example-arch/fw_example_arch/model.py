"""ParallelLM, built only from fw's shared layers (`fw.layers`).

A Llama variant with two research changes no Hugging Face class combines:

- a parallel block (GPT-J / PaLM): attention and MLP read the same normalised input and both add
  to the residual stream, ``x + attn(norm(x)) + mlp(norm(x))``, one norm per block instead of two;
- LayerNorm without bias (mean-centred, as in PaLM and OLMo) in place of RMSNorm, plus a per-head
  RMSNorm on queries and keys before rotary (QK-norm) to keep attention logits bounded.

Checkpoint tensor names follow Hugging Face's Llama layout where the layers are the same
(``model.layers.N.self_attn.q_proj.weight``, ``...mlp.gate_proj.weight``); the block's single
norm is ``model.layers.N.norm.weight``, the QK-norms ``...self_attn.q_norm.weight`` / ``k_norm``.
"""

from __future__ import annotations

import torch
from torch import nn

from fw.layers import CausalLM, GatedMLP, ModelContext, RotaryEmbedding, SelfAttention


def layer_norm(size: int, eps: float, dtype: torch.dtype) -> nn.LayerNorm:
    """Bias-free LayerNorm; its weight is loaded, so it is created without gradients."""
    norm = nn.LayerNorm(size, eps=eps, bias=False, dtype=dtype)
    norm.weight.requires_grad_(False)
    return norm


class ParallelBlock(nn.Module):
    def __init__(self, cfg, ctx: ModelContext, prefix: str):
        super().__init__()
        self.norm = layer_norm(cfg.hidden_size, cfg.norm_eps, ctx.dtype)
        # fused q/k/v and o projections, QK RMSNorm before rotary, fw's attention backend over the paged cache
        self.self_attn = SelfAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                       cfg.head_dim, ctx, f"{prefix}.self_attn", qk_norm_eps=cfg.norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, ctx, f"{prefix}.mlp", hidden_act=cfg.hidden_act)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], meta) -> torch.Tensor:
        h = self.norm(x)  # one norm feeds both branches
        return x + self.self_attn(h, cos_sin, meta) + self.mlp(h)


class ParallelLMModel(nn.Module):
    def __init__(self, cfg, ctx: ModelContext, max_positions: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=ctx.dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.rotary = RotaryEmbedding(cfg, cfg.head_dim, max_positions, ctx.dtype)
        self.layers = nn.ModuleList(ParallelBlock(cfg, ctx, f"model.layers.{i}") for i in range(cfg.num_hidden_layers))
        self.norm = layer_norm(cfg.hidden_size, cfg.norm_eps, ctx.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos_sin = self.rotary(positions)  # once per step, shared by every layer
        for layer in self.layers:
            x = layer(x, cos_sin, meta)
        return self.norm(x)


class ParallelLMForCausalLM(CausalLM):
    """fw's engine calls forward, compute_logits and load_weights; fw.layers.CausalLM provides them around
    `model`: the output projection (tied or not) and checkpoint loading, q/k/v into the fused qkv_proj and
    gate/up into gate_up_proj."""

    def __init__(self, cfg, ctx: ModelContext, max_positions: int | None = None):
        super().__init__(cfg, ctx, ParallelLMModel(cfg, ctx, max_positions or cfg.max_position_embeddings))


def build(cfg, ctx: ModelContext, max_positions: int | None = None) -> ParallelLMForCausalLM:
    return ParallelLMForCausalLM(cfg, ctx, max_positions)
