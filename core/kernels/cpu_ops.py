"""Fused CPU versions of the layers' element-wise ops: RMSNorm (with the residual add), rotary, SiLU * up.

Why: on a small model the decode step is mostly per-op overhead (~20 tiny torch
ops per layer), and prefill spends its non-matmul time in memory passes; each
of these ops is one C++ pass instead of 3-6 torch ops. The C++ (cpu_ops.cpp)
is built at model load with fw.kernels.loader and rounds every intermediate that
Hugging Face's torch code rounds, so the fused and torch paths agree to the
last bit except where fp32 sums are ordered differently.

The layers call these only when `ready()`: after `prepare(device)` built the
ops for a CPU model. Where they cannot be built (no compiler), or with
`FW_CPU_FUSED_OPS=0`, the layers keep their torch code.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from fw import env
from fw.kernels.loader import DEFAULT_CFLAGS, register_fake, try_load_cpp_ops

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_ops.cpp")  # package data
_CFLAGS = DEFAULT_CFLAGS + ("-ffp-contract=off",)  # a * b + c stays two roundings, as in torch
_ready = False
_op: dict[str, Any] = {}  # name -> torch op overload, once built


def wanted() -> bool:
    return env.CPU_FUSED_OPS.get()


def prepare(device: torch.device | str) -> str | None:
    """Build the ops for a model that will run on `device`; None when ready, else why not (logged)."""
    global _ready
    if torch.device(device).type != "cpu":
        return "not a CPU model"
    if not wanted():
        return "FW_CPU_FUSED_OPS=0"
    why = try_load_cpp_ops("cpu_ops", _SOURCE, _CFLAGS)
    if why is None:
        for name in ("rms_norm", "add_rms_norm", "rotary", "silu_mul", "argmax"):
            # the resolved overload: calling the packet resolves it again on every call (docs/performance.md)
            _op[name] = getattr(torch.ops.fw_cpu_ops, name).default
            register_fake(f"fw_cpu_ops::{name}", _no_output)  # each op writes into an argument, returns nothing
        _ready = True
        return None
    logger.warning("fused CPU layer ops unavailable (%s); using torch ops, which are slower", why)
    return why


def ready() -> bool:
    return _ready and wanted()


def usable(x: torch.Tensor) -> bool:
    """The ops take CPU tensors of 2 dims with contiguous rows."""
    return _ready and x.is_cpu and x.dim() == 2 and x.stride(1) == 1


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float) -> torch.Tensor:
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _op["rms_norm"](x, weight, eps, weight_offset, out)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 weight_offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual); the sum is written into `residual` itself."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _op["add_rms_norm"](x, residual, weight, eps, weight_offset, out)
    return out, residual


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rotate x [T, N * head_dim] in place by cos/sin [T, rotary_dim]; returns x."""
    _op["rotary"](x, cos, sin, head_dim)
    return x


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dim."""
    out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    _op["silu_mul"](gate_up, out)
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) for 2-D x: the first maximum (a NaN counts as the maximum), in one pass."""
    out = torch.empty(x.shape[0], dtype=torch.long)
    _op["argmax"](x, out)
    return out


def _no_output(*args, **kwargs) -> None:
    return None
