"""Rotary position embedding (rotate-half layout, as Hugging Face Llama).

Inverse frequencies come from transformers' own rope initialisers, so every
`rope_parameters` type they define (default, linear, llama3, yarn, ...) matches
the reference; cos/sin are cached for all positions once."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from fw.errors import ModelLoadError
from fw.kernels import cpu_ops
from fw.model.config import ModelConfig, RopeConfig, as_model_config

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def rope_inv_freq(rope: RopeConfig | ModelConfig | PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scaling of one rotary embedding (`rope`: a `RopeConfig`, or a
    model's config, whose `rope` is taken)."""
    if not isinstance(rope, RopeConfig):
        rope = as_model_config(rope).rope
    if rope.rope_type == "default":
        rotary_dim = int(head_dim * rope.partial_rotary_factor)
        return 1.0 / (rope.theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim)), 1.0
    if rope.rope_type == "dynamic":
        raise ModelLoadError("rope type 'dynamic' depends on the sequence length and is not supported yet")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # only scaled ropes pay for the import

    if rope.rope_type not in ROPE_INIT_FUNCTIONS:
        raise ModelLoadError(f"unknown rope type {rope.rope_type!r} in the model config")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope.rope_type](_TransformersRope(rope, head_dim), torch.device("cpu"))
    return inv_freq.float(), float(scaling)


class _TransformersRope:
    """What transformers' rope initialisers read from a config: the rope dict and the head size.
    `hidden_size` / `num_attention_heads` only back their `head_dim` fallback, which never applies."""

    def __init__(self, rope: RopeConfig, head_dim: int):
        self.rope_parameters = dict(rope.parameters)
        self.head_dim = head_dim
        self.hidden_size, self.num_attention_heads = head_dim, 1
        self.max_position_embeddings = rope.max_position_embeddings

    def standardize_rope_params(self) -> None:
        """`parameters` is standardised already (ModelConfig)."""


class RotaryEmbedding(nn.Module):
    """cos/sin of every position up to `max_positions`. `hf_config`: the model's `ModelConfig`, one
    layer type's `RopeConfig` (`ModelConfig.rope_for`), or a transformers config (read into a
    ModelConfig)."""

    def __init__(self, hf_config: ModelConfig | RopeConfig | PretrainedConfig, head_dim: int, max_positions: int,
                 dtype: torch.dtype):
        super().__init__()
        inv_freq, scaling = rope_inv_freq(hf_config, head_dim)
        self.rotary_dim = inv_freq.numel() * 2
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * scaling).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * scaling).to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, rotary_dim] for `positions` [T]: computed once per step, shared by all layers."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], head_dim: int):
    """q: [T, H*D], k: [T, Hkv*D] -> the same, rotated (rotate-half layout)."""
    return rotate_heads(q, cos_sin, head_dim), rotate_heads(k, cos_sin, head_dim)


def rotate_heads(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], head_dim: int) -> torch.Tensor:
    """x: [T, N*D], any number of heads N -> rotated. Rotating q and k as one [T, (H+Hkv)*D] slice of
    the fused qkv output halves the ops per layer, which is most of a small model's decode step."""
    cos, sin = cos_sin
    if cpu_ops.usable(x):
        return cpu_ops.rotary_(x.clone(), cos.squeeze(1), sin.squeeze(1), head_dim)
    return _apply(x, cos, sin, head_dim, cos.shape[-1])


def rotate_heads_(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], head_dim: int) -> torch.Tensor:
    """`rotate_heads` in place where the fused CPU op runs (x may be a column slice of a larger
    tensor, such as the q|k part of a fused qkv output); returns the rotated tensor either way."""
    cos, sin = cos_sin
    if cpu_ops.usable(x):
        return cpu_ops.rotary_(x, cos.squeeze(1), sin.squeeze(1), head_dim)
    return _apply(x, cos, sin, head_dim, cos.shape[-1])


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int, rotary_dim: int) -> torch.Tensor:
    t = x.shape[0]
    x = x.view(t, -1, head_dim)
    if rotary_dim < head_dim:
        rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
        return torch.cat((_rotate(rot, cos, sin), rest), dim=-1).view(t, -1)
    return _rotate(x, cos, sin).view(t, -1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
