"""The operators a compiled step calls opaquely, and the per-step context they read.

* `fw_compile::attention(q, k, v, layer)`: one attention layer, run by the
  engine's attention backend plugin outside the graph. Backends are plugins
  with their own kernels and Python metadata (block tables, per-step state),
  so, as vLLM does, the graph holds one opaque op per attention call and the
  op finds the layer and this step's metadata in `step_context`. Rows past
  the step's real token count are bucket padding: they never reach the
  backend, so they write no KV page, and their output is zeros.
* `fw_compile::moe_experts(x, weights, ids, layer)`: a Mixture-of-Experts
  layer's experts, run by its MoE kernel plugin the same way (how many
  tokens each expert gets depends on the routing: no static graph holds it).
* `fw_packed::linear(x, index, out_features)`: a dense linear on a weight
  in oneDNN's packed layout, from the running model's table of them
  (packed_linear.cpp says why).
* fw's CPU kernels (fw.kernels: `fw_cpu_ops::*`, `fw_dense::*`,
  `fw_packed_int::*`) register their fake implementations as they load, so
  they enter the graph as opaque calls instead of breaking it.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from fw import kernels
from fw.kernels import cpu_ops, dense, packed_int
from fw.kernels.loader import load_cpp_ops

PACKED_SOURCE = kernels.source("packed_linear.cpp")  # package data (fw.kernels)
_FUSED_CPU_OPS = ("rms_norm", "add_rms_norm", "rotary", "silu_mul", "argmax")


class _StepState(threading.local):
    layers: dict[str, Any] | None = None  # name -> Attention / FusedExperts module of the running model
    meta: Any = None  # this step's AttentionMetadata
    num_tokens: int = 0  # real tokens of the step; the rest of the bucket is padding


_state = _StepState()


@contextmanager
def step_context(layers: dict[str, Any], meta: Any, num_tokens: int, weights: int = -1) -> Iterator[None]:
    """What the ops need while a compiled step of one model runs on this thread: its attention and expert
    layers by name, this step's metadata and real token count, and its packed-weight table (-1: none)."""
    saved = _state.layers, _state.meta, _state.num_tokens
    _state.layers, _state.meta, _state.num_tokens = layers, meta, num_tokens
    previous = torch.ops.fw_packed.select_table(weights) if weights >= 0 else None
    try:
        yield
    finally:
        _state.layers, _state.meta, _state.num_tokens = saved
        if previous is not None:
            torch.ops.fw_packed.select_table(previous)


@torch.library.custom_op("fw_compile::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: str) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D] of a whole bucket -> [T, H, D]; the backend sees the real rows only."""
    if _state.layers is None:
        raise RuntimeError("fw_compile::attention ran outside fw.compile.ops.step_context")
    module = _state.layers[layer]
    backend = module.impl.inner
    n = _state.num_tokens
    if n == q.shape[0]:
        return backend.forward(q, k, v, module.kv_cache, _state.meta).contiguous()
    out = q.new_zeros(q.shape)
    if n:
        out[:n] = backend.forward(q[:n], k[:n], v[:n], module.kv_cache, _state.meta)
    return out


@attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: str) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.custom_op("fw_compile::moe_experts", mutates_args=())
def moe_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer: str) -> torch.Tensor:
    """x [T, hidden] of a whole bucket -> [T, hidden]; the MoE kernel sees the real rows only (its
    per-expert token counts depend on the routing, which no static graph can hold)."""
    if _state.layers is None:
        raise RuntimeError("fw_compile::moe_experts ran outside fw.compile.ops.step_context")
    module = _state.layers[layer]
    kernel = module.kernel.inner
    n = _state.num_tokens
    if n == x.shape[0]:
        return kernel.forward(module, x, topk_weights, topk_ids).contiguous()
    out = x.new_zeros(x.shape)
    if n:
        out[:n] = kernel.forward(module, x[:n], topk_weights[:n], topk_ids[:n])
    return out


@moe_experts.register_fake
def _(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


_lock = threading.Lock()
_packed_ready = False


def register_fused_cpu_fakes() -> None:
    """Make sure fw's CPU kernels that a model can use are loaded: each kernel module (fw.kernels) registers its
    ops' shape-only kernels as it loads them, so a compiled step traces them as opaque calls."""
    cpu_ops.ready()
    dense.bf16_kernel_ready()
    packed_int.ready()


def load_packed_linear() -> None:
    """Build (or load the cached build of) fw_packed and give its linear op a fake kernel."""
    global _packed_ready
    with _lock:
        if _packed_ready:
            return
        load_cpp_ops("fw_packed", PACKED_SOURCE)
        torch.library.register_fake("fw_packed::linear")(_packed_linear_fake)
        _packed_ready = True


def _packed_linear_fake(x: torch.Tensor, index: int, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


def new_packed_table() -> int:
    """A table of packed weights for one model (graphs name weights by their index in it)."""
    load_packed_linear()
    return int(torch.ops.fw_packed.new_table())


def register_packed_weight(table: int, weight: torch.Tensor, bias: torch.Tensor | None) -> int:
    return int(torch.ops.fw_packed.register_weight(table, weight, bias))


def release_packed_table(table: int) -> None:
    """Drop the table's references (called when the model it belongs to is collected)."""
    torch.ops.fw_packed.release_table(table)


def packed_linear(x: torch.Tensor, index: int, out_features: int) -> torch.Tensor:
    """x [..., in] -> [..., out_features] through weight `index` of the table `step_context` selected."""
    if x.dim() == 2 and x.is_contiguous():
        return torch.ops.fw_packed.linear.default(x, index, out_features)
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    return torch.ops.fw_packed.linear.default(flat, index, out_features).view(*x.shape[:-1], out_features)
