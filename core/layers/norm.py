"""RMSNorm with Hugging Face Llama numerics (normalise in fp32, scale in the model dtype)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, weight_offset: float = 0.0):
        super().__init__()
        self.eps = eps
        self.weight_offset = weight_offset  # Gemma stores (weight - 1)
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With `residual`, returns (norm(x + residual), x + residual): the fused pre-norm pattern."""
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = F.rms_norm(x.float(), x.shape[-1:], eps=self.eps)  # one call, the same values as the 5-op form
        weight = self.weight if self.weight_offset == 0.0 else self.weight.float() + self.weight_offset
        out = weight * h.to(dtype)
        return out if residual is None else (out, residual)
