"""LoRA on fw's linear layers: the layer's own method (dense or quantized) plus, per adapter, one shrink
and one expand over the rows of the step that run with it.

Adapters land on fw's fused layers by output slice: q/k/v's updates go into `qkv_proj`'s three row
ranges, gate/up's into `gate_up_proj`'s two. Each adapter keeps, per layer, the A matrices of its
shards stacked, [shards * r, in], and their B matrices block-diagonal, [out, shards * r], with the
scale folded in, so a group of rows costs two matmuls whatever the layer fuses."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fw.layers.linear import LinearMethod


# Steps of at most this many rows (decodes) compute the update in float32 on a bf16/fp16 model: torch's
# half-precision CPU matmuls of these shapes (a few rows by a rank-sized inner dimension) took 3x float32's
# time here; larger steps keep the model dtype, where they are faster.
SMALL_ROWS = 8


@dataclass
class LoRAStep:
    """The step's rows per adapter slot, shared by every LoRA layer: (slot, rows) with rows an index
    tensor, or None for every row of the step. Set by `LoRAManager.prepare_step` before the forward."""

    groups: list[tuple[int, torch.Tensor | None]] = field(default_factory=list)


class LoRALinearMethod(LinearMethod):
    """Wraps a layer's method: `apply` is the base method's output plus each active adapter's update;
    creating, loading and packing the base weight stay the base method's."""

    def __init__(self, base: LinearMethod, step: LoRAStep):
        self.base = base
        self.step = step
        # slot -> (A^T [in, k*r], scale * B^T [k*r, out]) in the model dtype, and in float32 (or None when that
        # is the model dtype) for small steps
        self.adapters: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = {}

    def __getattr__(self, name: str):
        # what other code asks of the base method (keeps_gguf_blocks, method_for, ...) still answers
        if name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)

    def create_weights(self, layer) -> None:
        self.base.create_weights(layer)

    def load_weight(self, layer, param_name: str, tensor: torch.Tensor, shard: int | None) -> None:
        self.base.load_weight(layer, param_name, tensor, shard)

    def process_weights_after_loading(self, layer) -> None:
        self.base.process_weights_after_loading(layer)

    def weight_bytes(self, layer) -> int:
        return self.base.weight_bytes(layer)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        y = self.base.apply(layer, x)
        for slot, rows in self.step.groups:
            lora = self.adapters.get(slot)
            if lora is None:
                continue
            a, b, a32, b32 = lora
            if rows is None and a32 is not None and x.dim() == 2 and x.shape[0] <= SMALL_ROWS:
                y.add_(torch.mm(torch.mm(x.float(), a32), b32).to(y.dtype))
            elif rows is None:
                y = y.addmm_(torch.mm(x, a), b) if y.dim() == 2 else y + (x @ a) @ b
            else:
                y.index_add_(0, rows, torch.mm(torch.mm(x.index_select(0, rows), a), b))
        return y
