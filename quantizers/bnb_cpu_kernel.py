"""bitsandbytes' fused CPU 4-bit matmul (nf4/fp4, AVX512-BF16) for fw's 4-bit linears on bf16 CPU models.

The kernel is the library's own: its repack (`_convert_weight_packed_for_cpu`, as its `Linear4bit` does on
the first CPU forward) and its C entry point (`gemv_4bit_inference_cpu_{nf4,fp4}_bf16`, what
`F.gemv_4bit` runs on CPU). In eager mode fw calls that entry point through ctypes with the layer's
arguments prepared once: `F.gemv_4bit`'s Python wrapper (a Python-registered torch op, a `code[1] > 0`
read of a tensor, the output copy) costs more per call than the kernel itself at decode sizes (figures in
docs/quantization.md). Each group of rows writes straight into its columns of one output, so fused
q/k/v and gate/up shards need no concatenation. Under `torch.compile` the registered op `F.gemv_4bit`
is used, which the compiler traces.
"""

from __future__ import annotations

import copy
import ctypes
import functools
from dataclasses import dataclass
from typing import Any

import torch

_ENTRY_POINTS = {"nf4": "gemv_4bit_inference_cpu_nf4_bf16", "fp4": "gemv_4bit_inference_cpu_fp4_bf16"}
# void f(M, N, K, const bf16* x, const uint8* w, const bf16* absmax, bf16* out, blocksize, x_strideM, out_strideM)
_PROTOTYPE = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                              ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                              ctypes.c_int64)
_BF16_BYTES = 2


def available(bnb: Any) -> bool:
    """The library can repack for its CPU kernel and this CPU runs it (AVX512-BF16)."""
    F = bnb.functional
    return hasattr(F, "_convert_weight_packed_for_cpu") and bool(F.has_avx512bf16())


@functools.cache
def entry_point(bnb: Any, quant_type: str) -> Any | None:
    """The kernel's C function as a ctypes function taking plain ints, or None when this build lacks it
    (then `F.gemv_4bit` is called instead). A prototype of fw's own keeps the library's function object,
    which its Python wrapper calls, untouched. One per quant type, shared by every layer."""
    from bitsandbytes.cextension import lib  # here: bitsandbytes costs start-up time

    native = getattr(getattr(lib, "_lib", None), _ENTRY_POINTS[quant_type], None)
    if native is None:
        return None
    return _PROTOTYPE(ctypes.cast(native, ctypes.c_void_p).value)


@dataclass(frozen=True)
class KernelGroup:
    """One group of merged shards in the kernel's layout: its weight and quant state (bf16 absmax in the
    kernel's order), its rows and its first output column."""

    weight: torch.Tensor
    state: Any
    rows: int
    column: int


class CpuGemv4bit:
    """y = x @ W^T for a layer whose groups were repacked for the library's kernel."""

    def __init__(self, bnb: Any, groups: list[KernelGroup], in_features: int, quant_type: str):
        self.bnb = bnb
        self.groups = groups
        self.in_features = in_features
        self.out_features = sum(g.rows for g in groups)
        self.native = entry_point(bnb, quant_type)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is None or torch.compiler.is_compiling():
            return self._through_library(x)
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != torch.bfloat16:
            rows = rows.to(torch.bfloat16)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        m = rows.shape[0]
        out = torch.empty(m, self.out_features, dtype=torch.bfloat16)
        if m:
            x_ptr, out_ptr = rows.data_ptr(), out.data_ptr()
            for g in self.groups:
                self.native(m, g.rows, self.in_features, x_ptr, g.weight.data_ptr(), g.state.absmax.data_ptr(),
                            out_ptr + g.column * _BF16_BYTES, g.state.blocksize, rows.stride(0),
                            self.out_features)
        out = out.view(*lead, self.out_features)
        return out if x.dtype == torch.bfloat16 else out.to(x.dtype)

    def _through_library(self, x: torch.Tensor) -> torch.Tensor:
        outs = [self.bnb.functional.gemv_4bit(x, g.weight, state=g.state) for g in self.groups]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def dequantized(self) -> torch.Tensor:
        """[out, in] float32: the library's inverse repack, then its `dequantize_4bit`, per group."""
        return torch.cat([dequantize_repacked(self.bnb.functional, g.weight, g.state) for g in self.groups])


def repack(bnb: Any, packed: list[torch.Tensor], states: list[Any]) -> tuple[torch.Tensor, torch.Tensor,
                                                                             list[KernelGroup]]:
    """Each group in the kernel's layout (the library's repack; its absmax become bf16, contiguous):
    returns the flat weight and absmax of all groups and the groups as views into them."""
    F = bnb.functional
    repacked = [F._convert_weight_packed_for_cpu(p.clone(), s) for p, s in zip(packed, states)]
    weight = torch.cat([w.reshape(-1) for w, _ in repacked])
    absmax = torch.cat([s.absmax.reshape(-1).to(torch.bfloat16) for _, s in repacked])
    groups, w0, a0, column = [], 0, 0, 0
    for w, state in repacked:
        state.absmax = absmax[a0:a0 + state.absmax.numel()].view(state.absmax.shape)
        groups.append(KernelGroup(weight[w0:w0 + w.numel()].view(w.shape), state, state.shape[0], column))
        w0, a0, column = w0 + w.numel(), a0 + state.absmax.numel(), column + state.shape[0]
    return weight, absmax, groups


def dequantize_repacked(F: Any, weight: torch.Tensor, state: Any) -> torch.Tensor:
    """[rows, in] of a group in the kernel's layout: the library's inverse repack, then its
    `dequantize_4bit`. The inverse leaves a non-nested absmax in the kernel's order ([in / blocksize, rows],
    bf16), which `dequantize_4bit` would read as row-major blocks: it is put back in row order here."""
    kernel_absmax = state.absmax
    weight, state = F._convert_weight_packed_for_cpu_inverse(weight, copy.copy(state))
    if not state.nested:
        state.absmax = kernel_absmax.T.reshape(-1).float()
    return F.dequantize_4bit(weight, state).reshape(state.shape[0], -1)
