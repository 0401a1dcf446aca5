"""Rotary position embedding (rotate-half layout, as Hugging Face Llama).

Inverse frequencies come from transformers' own rope initialisers, so every
`rope_parameters` type they define (default, linear, llama3, yarn, ...) matches
the reference; cos/sin are cached for all positions once."""

from __future__ import annotations

import torch
from torch import nn

from fw.errors import ModelLoadError
from fw.layers import cpu_ops


def rope_inv_freq(hf_config, head_dim: int) -> tuple[torch.Tensor, float]:
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim)), 1.0
    if rope_type == "dynamic":
        raise ModelLoadError("rope type 'dynamic' depends on the sequence length and is not supported yet")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ModelLoadError(f"unknown rope type {rope_type!r} in the model config")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    def __init__(self, hf_config, head_dim: int, max_positions: int, dtype: torch.dtype):
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
