"""MoE expert-computation cases for `fw bench kernels --kind moe`.

Each case is one MoE layer's experts (`FusedExperts` with the kernel under test, random weights,
the kernel's `process_weights_after_loading` run once) on T tokens routed by a softmax top-k over
random router logits, so experts are picked about evenly, as a trained router's load balancing
aims for. The router itself is not timed: it is the same for every kernel.

Traffic model (bytes): the gate/up and down weights of every expert at least one token picked
(read once each: the floor for any kernel), x read and the output written. FLOPs: 2 per weight per
assignment, 2 * T * k * 3 * H * I.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from fw.commands.bench.kernels_case import KernelCase
from fw.devices import cuda_capability
from fw.layers import FusedExperts, ModelContext, topk_routing
from fw.plugins.specs import MoeRequirements


@dataclass(frozen=True)
class MoeShape:
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    activation: str = "silu"


def requirements(device: torch.device, dtype: torch.dtype, shape: MoeShape) -> MoeRequirements:
    return MoeRequirements(device=device.type, dtype=str(dtype).removeprefix("torch."),
                           num_experts=shape.num_experts, top_k=shape.top_k, hidden_size=shape.hidden_size,
                           intermediate_size=shape.intermediate_size, activation=shape.activation,
                           capability=cuda_capability(device))


def build_experts(spec, device: torch.device, dtype: torch.dtype, shape: MoeShape, seed: int) -> FusedExperts:
    """A FusedExperts layer computed by `spec`'s kernel, weights ~ N(0, 1/sqrt(fan-in)) so outputs stay O(1)."""
    ctx = ModelContext(dtype=dtype, device=device, attention_backend=None,
                       extra={"moe_kernel": lambda req: spec.kernel_cls()})
    with torch.device(device):
        layer = FusedExperts(shape.num_experts, shape.hidden_size, shape.intermediate_size, shape.top_k, ctx,
                             "bench.experts", hidden_act=shape.activation)
    gen = torch.Generator(device=device).manual_seed(seed)
    layer.gate_up_proj.data.normal_(0.0, shape.hidden_size ** -0.5, generator=gen)
    layer.down_proj.data.normal_(0.0, shape.intermediate_size ** -0.5, generator=gen)
    layer.kernel.process_weights_after_loading(layer)
    return layer


def traffic(num_tokens: int, active_experts: int, shape: MoeShape, itemsize: int) -> tuple[int, int]:
    """(bytes moved, FLOPs) of one call."""
    weights = active_experts * 3 * shape.hidden_size * shape.intermediate_size * itemsize
    activations = 2 * num_tokens * shape.hidden_size * itemsize
    flops = 2 * num_tokens * shape.top_k * 3 * shape.hidden_size * shape.intermediate_size
    return weights + activations, flops


def moe_cases(spec, device: torch.device, dtype: torch.dtype, shape: MoeShape, num_tokens: list[int],
              free_bytes: int | None, seed: int) -> Iterator[KernelCase]:
    """One case per token count; the layer's weights are built once per kernel."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    weight_bytes = 3 * shape.num_experts * shape.hidden_size * shape.intermediate_size * itemsize
    if free_bytes is not None and weight_bytes > 0.85 * free_bytes:
        for tokens in num_tokens:
            yield KernelCase(spec.name, {"tokens": tokens}, 0, 0, skipped=(
                f"needs {weight_bytes / 2**30:.1f} GiB of expert weights, {free_bytes / 2**30:.1f} GiB free"))
        return
    layer = build_experts(spec, device, dtype, shape, seed)
    for tokens in num_tokens:
        gen = torch.Generator(device=device).manual_seed(seed + tokens)
        x = torch.randn(tokens, shape.hidden_size, dtype=dtype, device=device, generator=gen)
        logits = torch.randn(tokens, shape.num_experts, dtype=dtype, device=device, generator=gen)
        weights, ids = topk_routing(logits, shape.top_k, renormalize=True, weights_in_model_dtype=False)
        active = int(torch.unique(ids).numel())
        nbytes, flops = traffic(tokens, active, shape, itemsize)

        def run(x=x, weights=weights, ids=ids) -> None:
            layer(x, weights, ids)

        yield KernelCase(spec.name, {"tokens": tokens}, nbytes, flops, run=run, extra={"active_experts": active})
        del x, logits, weights, ids, run
    del layer
