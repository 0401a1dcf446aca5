"""Make a loaded fw model traceable by torch.compile without changing what it computes.

Four things stop dynamo in an eager-tuned fw model, and each gets a stand-in
installed on the model instance (nothing in fw.layers changes):

* attention: each layer's backend instance is wrapped in `OpaqueAttention`,
  whose forward, while traced, calls the `fw_compile::attention` op
  (fw.compile.ops); the real backend runs inside the op, outside the graph;
* Mixture-of-Experts layers: their kernel plugin is wrapped the same way
  (`OpaqueMoeKernel`, the `fw_compile::moe_experts` op);
* dense linears whose weight fw packed for oneDNN (fw.kernels.dense): their
  `method` becomes `PackedLinearMethod`, which, while traced, calls
  `fw_packed::linear` with the weight's index in the model's table (the
  opaque packed tensor cannot be traced);
* the tied output layer's packed copy (`CausalLM.tied_head`): the same op,
  through an instance-level `compute_logits`, when the class keeps the base
  `compute_logits`. A family that overrides it (Gemma's soft-cap) keeps its
  head eager (CompiledStep notices the failed trace).

Run eagerly, the model computes exactly what it did before (the stand-ins
call the original code, and the attention op runs the backend), so a step
that no bucket holds still runs, and so do prompt logprobs, which go through
`compute_logits` outside any compiled graph.
"""

from __future__ import annotations

import types
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fw.compile import ops
from fw.layers.attention import Attention
from fw.layers.causal_lm import CausalLM
from fw.layers.linear import Linear, LinearMethod, UnquantizedLinearMethod
from fw.layers.moe import FusedExperts


class OpaqueAttention:
    """Stands in for one layer's attention backend instance; `inner` is the backend."""

    def __init__(self, name: str, inner: Any):
        self.name = name
        self.inner = inner

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache, meta) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.fw_compile.attention(q, k, v, self.name)
        return self.inner.forward(q, k, v, kv_cache, meta)

    def __getattr__(self, name: str) -> Any:  # scale, window, k_scale, ...: the backend's own
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


class OpaqueMoeKernel:
    """Stands in for one MoE layer's kernel instance; `inner` is the kernel."""

    def __init__(self, name: str, inner: Any):
        self.name = name
        self.inner = inner

    def forward(self, experts, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.fw_compile.moe_experts(x, topk_weights, topk_ids, self.name)
        return self.inner.forward(experts, x, topk_weights, topk_ids)

    def __getattr__(self, name: str) -> Any:  # process_weights_after_loading, ...: the kernel's own
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


class PackedLinearMethod(LinearMethod):
    """UnquantizedLinearMethod, whose packed weight a traced graph reaches by its index in the model's
    table; run eagerly, the original method runs (the same oneDNN call)."""

    def __init__(self, index: int, out_features: int, original: LinearMethod):
        self.index = index
        self.out_features = out_features
        self.original = original

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return ops.packed_linear(x, self.index, self.out_features)
        return self.original.apply(layer, x)

    def weight_bytes(self, layer: "Linear") -> int:
        return self.original.weight_bytes(layer)


def compute_logits(self: CausalLM, hidden: torch.Tensor) -> torch.Tensor:
    """The tied head's stand-in, installed as the instance's `compute_logits`: named so, because a saved
    graph (fw.compile.graphs) pickles a bound method as its object and the attribute of that name."""
    if torch.compiler.is_compiling():
        return ops.packed_linear(hidden, self._fw_tied_index, self.config.vocab_size)
    return CausalLM.compute_logits(self, hidden)


@dataclass
class Traceable:
    """What a compiled step of the model passes to `ops.step_context`."""

    layers: dict[str, nn.Module]  # name -> Attention or FusedExperts (the opaque ops' layers)
    weights: int = -1  # the model's packed-weight table, -1 when it has none


def make_traceable(model: nn.Module) -> Traceable:
    """Install the stand-ins (once per model)."""
    existing = getattr(model, "_fw_traceable", None)
    if existing is not None:
        return existing
    layers: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if isinstance(module, Attention):
            module.impl = OpaqueAttention(name, module.impl)
            layers[name] = module
        elif isinstance(module, FusedExperts):
            module.kernel = OpaqueMoeKernel(name, module.kernel)
            layers[name] = module
    packed = [m for m in model.modules()
              if isinstance(m, Linear) and type(m.method) is UnquantizedLinearMethod and m.weight.is_mkldnn]
    tied = getattr(model, "tied_head", None)
    tied = tied if isinstance(model, CausalLM) and tied is not None and tied.is_mkldnn else None
    table = -1
    if packed or tied is not None:
        table = ops.new_packed_table()
        weakref.finalize(model, ops.release_packed_table, table)
        for module in packed:
            index = ops.register_packed_weight(table, module.weight, module.bias)
            module.method = PackedLinearMethod(index, module.output_size, module.method)
        if tied is not None:
            model._fw_tied_index = ops.register_packed_weight(table, tied, None)
            if type(model).compute_logits is CausalLM.compute_logits:
                model.compute_logits = types.MethodType(compute_logits, model)
    ops.register_fused_cpu_fakes()
    model._fw_traceable = Traceable(layers, table)
    return model._fw_traceable
