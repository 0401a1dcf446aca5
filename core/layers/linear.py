"""Linear layers that delegate parameter creation, loading and matmul to a
`LinearMethod` (the quantization-method contract; unquantized is the default).

A `Linear` may fuse several output shards (q/k/v, gate/up): `output_sizes`
lists them, and the checkpoint's separate tensors load into their slices.
"""

from __future__ import annotations

import torch
from torch import nn

from fw.kernels import dense
from fw.kernels.step_program import NotReplayable, replays
from fw.kernels.dense import DenseLayout, blocked_bf16_buffer, blocked_layout, blocked_view, pack_dense, pack_rows_into


class LinearMethod:
    """How a linear layer stores and applies its weight. Quantization plugins subclass this."""

    def create_weights(self, layer: "Linear") -> None:
        raise NotImplementedError

    def load_weight(self, layer: "Linear", param_name: str, tensor: torch.Tensor, shard: int | None) -> None:
        """Copy a checkpoint tensor into the layer; `shard` indexes `layer.output_sizes` for fused layers."""
        param = getattr(layer, param_name)
        if shard is None:
            if param.shape != tensor.shape:
                raise ValueError(f"{layer.prefix}.{param_name}: checkpoint shape {tuple(tensor.shape)} "
                                 f"!= expected {tuple(param.shape)}")
            param.data.copy_(tensor)
            return
        start = sum(layer.output_sizes[:shard])
        size = layer.output_sizes[shard]
        target = param.data.narrow(0, start, size)
        if target.shape != tensor.shape:
            raise ValueError(f"{layer.prefix}.{param_name}[shard {shard}]: checkpoint shape "
                             f"{tuple(tensor.shape)} != expected {tuple(target.shape)}")
        target.copy_(tensor)

    def process_weights_after_loading(self, layer: "Linear") -> None:
        """Repack after all shards are loaded (e.g. into a kernel's layout)."""

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def silu_mul(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of a SiLU MLP's fused [gate; up] projection (`layer.silu_gate_up`), where this
        method's kernel computes it in the product; None (the default) has the MLP apply the layer and the
        activation in turn."""
        return None

    def weight_bytes(self, layer: "Linear") -> int:
        return sum(p.numel() * p.element_size() for p in layer.parameters(recurse=False))

    def emit_step(self, layer: "Linear", b, x):
        """`apply` as a step program's calls on register x (fw.layers.replay: the layers' calls replayed from
        C++); returns the output's register. The default refuses: a method is replayed only where it says
        how, with the very calls its `apply` makes."""
        raise NotReplayable(f"{type(self).__name__} has no step program")

    def emit_silu_step(self, layer: "Linear", b, x):
        """`silu_mul` as a step program's calls; None where `silu_mul` returns None."""
        return None


class UnquantizedLinearMethod(LinearMethod):
    """Dense weights in the model dtype: the reference every quantizer is compared with.

    Where fw's bf16 CPU kernel runs them, the checkpoint's tensors are written straight into its blocked
    layout as they are read (`dense.pack_rows_into`): the plain weight is never written, which saves a
    start a copy of every weight and the memory it would first touch."""

    def create_weights(self, layer: "Linear") -> None:
        layer.weight = nn.Parameter(
            torch.empty(sum(layer.output_sizes), layer.input_size, dtype=layer.params_dtype), requires_grad=False
        )
        layer.dense_layout = DenseLayout.PLAIN  # until loading packs it (`dense.pack_dense` says which layout)
        layer._blocked_room = blocked_bf16_buffer(layer.output_size, layer.input_size, layer.device) \
            if layer.params_dtype == torch.bfloat16 else None

    def load_weight(self, layer: "Linear", param_name: str, tensor: torch.Tensor, shard: int | None) -> None:
        room = layer.__dict__.pop("_blocked_room", None) if param_name == "weight" else None
        if room is not None:  # the first shard: shape the room now that silu_gate_up is known
            gate_up = layer.silu_gate_up and layer.bias is None
            layer.dense_layout = blocked_layout(layer.output_size, gate_up)
            layer._blocked = blocked_view(room, layer.output_size, layer.input_size, gate_up)
        blocked = layer.__dict__.get("_blocked") if param_name == "weight" else None
        if blocked is None:
            super().load_weight(layer, param_name, tensor, shard)
            return
        start = 0 if shard is None else sum(layer.output_sizes[:shard])
        size = layer.output_size if shard is None else layer.output_sizes[shard]
        if tuple(tensor.shape) != (size, layer.input_size):
            where = "" if shard is None else f"[shard {shard}]"
            raise ValueError(f"{layer.prefix}.weight{where}: checkpoint shape {tuple(tensor.shape)} "
                             f"!= expected {(size, layer.input_size)}")
        pack_rows_into(blocked, tensor, start)

    def process_weights_after_loading(self, layer: "Linear") -> None:
        layer.__dict__.pop("_blocked_room", None)
        blocked = layer.__dict__.pop("_blocked", None)
        if blocked is not None:  # written as it was read
            layer.weight = nn.Parameter(blocked, requires_grad=False)
            return
        gate_up = layer.silu_gate_up and layer.bias is None
        packed, layer.dense_layout = pack_dense(layer.weight.data, layer.device, gate_up=gate_up)
        if packed is not layer.weight.data:
            layer.weight = nn.Parameter(packed, requires_grad=False)

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        return dense.linear(x, layer.weight, layer.dense_layout, layer.bias)

    def silu_mul(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor | None:
        if dense.fuses_silu(layer):  # packed for it at load
            return dense.dense_silu_mul(x, layer.weight)
        return None

    def emit_step(self, layer: "Linear", b, x):
        return dense.emit_linear(b, x, layer.weight, layer.dense_layout, layer.bias)

    def emit_silu_step(self, layer: "Linear", b, x):
        if dense.fuses_silu(layer):
            return dense.emit_silu_mul(b, x, layer.weight)
        return None


class Linear(nn.Module):
    """y = x W^T + b, with W owned by a `LinearMethod`."""

    def __init__(
        self,
        input_size: int,
        output_sizes: int | list[int],
        ctx,
        prefix: str,
        bias: bool = False,
    ):
        super().__init__()
        self.input_size = input_size
        self.output_sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        self.output_size = sum(self.output_sizes)
        self.prefix = prefix
        self.params_dtype = ctx.dtype
        self.device = ctx.device  # where the model will run (it is built and loaded on the CPU)
        # set by a SiLU MLP before loading: the output is [gate | up], so the unquantized method may pack
        # the weight for fw.layers.dense_silu_mul (fw's bf16 CPU kernel fuses the activation)
        self.silu_gate_up = False
        # set on an LM head: a method whose kernel can leave the sums in fp32 does (bf16 logits tie and flip
        # greedy choices); others return the model dtype
        self.fp32_out = False
        self.method = ctx.linear_method_for(prefix)
        self.method.create_weights(self)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.output_size, dtype=ctx.dtype), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def load_weight(self, param_name: str, tensor: torch.Tensor, shard: int | None = None) -> None:
        if param_name == "bias":
            LinearMethod.load_weight(self.method, self, "bias", tensor.to(self.params_dtype), shard)
        else:
            self.method.load_weight(self, param_name, tensor, shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def emit_step(self, b, x):
        """`forward` as a step program's calls (fw.layers.replay): the method's."""
        replays(self, Linear)
        return self.method.emit_step(self, b, x)
