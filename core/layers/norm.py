"""RMSNorm with Hugging Face numerics, the rounding order an explicit option (docs/plugin-authors/blocks.md).

In bf16 the two families round differently: Llama (and Qwen, Mistral, ...) rounds the normalised
x to the model dtype and then multiplies by the weight in that dtype; OLMo 2 and Gemma multiply in
fp32 and round once. Greedy tokens in bf16 follow the order the checkpoint was trained with."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from fw.kernels import cpu_ops
from fw.kernels.step_program import NotReplayable, replays

Rounding = Literal["round_then_scale", "scale_then_round"]
ROUNDINGS: tuple[str, ...] = ("round_then_scale", "scale_then_round")


class RMSNorm(nn.Module):
    """`rounding`: "round_then_scale" (Llama: `weight * x_hat.to(dtype)`) or "scale_then_round"
    (OLMo 2, Gemma: `(weight * x_hat).to(dtype)` in fp32). The default is Llama's without a
    `weight_offset` and Gemma's with one (Gemma stores weight - 1). In fp32 the two agree."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, weight_offset: float = 0.0,
                 rounding: Rounding | None = None):
        super().__init__()
        if rounding is None:
            rounding = "scale_then_round" if weight_offset else "round_then_scale"
        if rounding not in ROUNDINGS:
            raise ValueError(f"RMSNorm rounding {rounding!r} is not one of {', '.join(ROUNDINGS)}")
        self.eps = eps
        self.weight_offset = weight_offset
        self.rounding = rounding
        # fw's CPU kernel scales in fp32 exactly when the offset is non-zero; an offset-free
        # scale_then_round norm takes the torch path
        self.fused_ok = (rounding == "scale_then_round") == bool(weight_offset)
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With `residual`, returns (norm(x + residual), x + residual): the fused pre-norm pattern.
        On CPU with the fused ops built, the sum is written into `residual` itself."""
        if self.fused_ok and cpu_ops.usable(x) and (residual is None or cpu_ops.usable(residual)):
            if residual is None:
                return cpu_ops.rms_norm(x, self.weight, self.eps, self.weight_offset)
            return cpu_ops.add_rms_norm(x, residual, self.weight, self.eps, self.weight_offset)
        if residual is not None:
            x = x + residual
            residual = x
        if self.rounding == "round_then_scale":
            weight = self.weight + self.weight_offset if self.weight_offset else self.weight
            out = weight * _rms_normalize(x, self.eps)
        else:
            out = (_rms_normalize(x.float(), self.eps) * (self.weight.float() + self.weight_offset)).to(x.dtype)
        return out if residual is None else (out, residual)

    def emit_step(self, b, x, residual=None):
        """`forward` as a step program's calls (fw.layers.replay): the fused CPU op's path only."""
        replays(self, RMSNorm)
        if not (self.fused_ok and cpu_ops.ready()):
            raise NotReplayable("an RMSNorm off fw's fused CPU op")
        out = b.empty(x)
        if residual is None:
            b.call("fw_cpu_ops::rms_norm", x, self.weight, self.eps, self.weight_offset, out)
            return out
        b.call("fw_cpu_ops::add_rms_norm", x, residual, self.weight, self.eps, self.weight_offset, out)
        return out, residual


def _rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps), computed in fp32 and rounded to x's dtype (HF's numerics).

    Layer norm of [x, -x] is exactly that: the mean is 0 and the variance is mean(x^2). torch has a
    fused CPU layer_norm kernel (fp32 inside for bf16 input) but composes rms_norm from five ops, so
    this form is faster (docs/performance.md) and differs from the five-op form in a small fraction
    of bf16 outputs, by one unit in the last place."""
    n = x.shape[-1]
    return F.layer_norm(torch.cat((x, -x), dim=-1), (2 * n,), eps=eps)[..., :n]
