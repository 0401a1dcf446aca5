"""AWQ checkpoints in the GEMM layout (`quant_method: "awq"`, `version: "gemm"`), the
reference path in plain torch.

On-disk format (AutoAWQ's WQLinear_GEMM, as transformers and vLLM read it), per
quantized linear with in_features I, out_features O and G = I / group_size groups:

- `qweight` int32 [I, O / 8]: 4-bit values packed along the output dimension in
  AWQ's interleaved order: int32 column c holds output columns
  c*8 + [0, 2, 4, 6, 1, 3, 5, 7] in nibbles 0..7 (lowest bits first).
- `qzeros` int32 [G, O / 8]: the zero points, packed the same way (stored as is).
- `scales` float [G, O].
- W[o, i] = scales[i // group_size, o] * (q[i, o] - zero[i // group_size, o]).

Weights stay packed in memory. On CPU they move onto fw's packed-int kernels at load;
on CUDA they are repacked once at load into GPTQ's layout (codes packed along the
input, zeros in natural order: the same bytes) so that decode-sized products run
gptq_triton's W4A16 kernel; otherwise each matmul dequantizes a block of output
columns at a time. Fused fw layers concatenate each projection's packed columns. The LM
head stays in float (AWQ never quantizes it); `modules_to_not_convert` is honoured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fw.errors import ConfigError
from fw.layers import Linear, LinearMethod, UnquantizedLinearMethod
from fw.kernels import packed_int
from fw.plugins import QuantizationMethodSpec, Verified, hookimpl
from fw.quantizers._packing import (AWQ_REVERSE_ORDER, GROUPED_MAX_ROWS, check_bits, column_blocks, copy_checked,
                                    grouped_matmul, left_unquantized, pack_int32, repack_for_kernels,
                                    runs_w4a16_triton, shard_columns, unpack_int32)

FW_PLUGIN_API_VERSION = "1.2"  # verified_on

PACK = 8  # 4-bit values per int32


@dataclass(frozen=True)
class AWQConfig:
    group_size: int  # -1: one group over the whole input

    @classmethod
    def from_dict(cls, qcfg: dict) -> "AWQConfig":
        if not qcfg:
            raise ConfigError("--quantization awq loads AWQ checkpoints; this checkpoint has no "
                              "quantization_config. Quantize on load with --quantization fp8 or "
                              "bitsandbytes-*, or use an AWQ checkpoint")
        check_bits("awq", int(qcfg.get("bits", qcfg.get("w_bit", 4))), (4,))
        version = str(qcfg.get("version", "gemm")).lower()
        if version != "gemm":
            raise ConfigError(f"awq: version {version!r} is not supported; fw reads the GEMM layout "
                              f"(version: \"gemm\", AutoAWQ's default). Re-export the checkpoint as GEMM")
        if not qcfg.get("zero_point", True):
            raise ConfigError("awq: zero_point false (symmetric AWQ) is not supported; fw reads AWQ's "
                              "asymmetric GEMM layout with qzeros")
        group_size = int(qcfg.get("group_size", qcfg.get("q_group_size", 128)))
        if group_size == 0 or group_size < -1:
            raise ConfigError(f"awq: group_size {group_size} is not valid (a positive size, or -1 for one group)")
        return cls(group_size)


def detects(qcfg: dict) -> bool:
    return str(qcfg.get("quant_method", "")).lower() == "awq"


class AWQLinearMethod(packed_int.PackedIntSteps, LinearMethod):
    """Packed AWQ GEMM weights, dequantized block by block inside each matmul."""

    def __init__(self, quant_config: dict):
        self.quant_config = dict(quant_config)
        self.config = AWQConfig.from_dict(self.quant_config)

    def method_for(self, prefix: str) -> LinearMethod:
        return UnquantizedLinearMethod() if left_unquantized(prefix, self.quant_config) else self

    def group_size(self, layer: Linear) -> int:
        return layer.input_size if self.config.group_size == -1 else self.config.group_size

    def create_weights(self, layer: Linear) -> None:
        gs = self.group_size(layer)
        if layer.input_size % gs:
            raise ValueError(f"{layer.prefix}: input size {layer.input_size} is not a multiple of the AWQ "
                             f"group size {gs}")
        if layer.output_size % PACK:
            raise ValueError(f"{layer.prefix}: output size {layer.output_size} is not a multiple of {PACK}, the "
                             f"4-bit values AWQ packs per int32")
        groups, cols = layer.input_size // gs, layer.output_size // PACK
        layer.qweight = nn.Parameter(torch.zeros(layer.input_size, cols, dtype=torch.int32), requires_grad=False)
        layer.qzeros = nn.Parameter(torch.zeros(groups, cols, dtype=torch.int32), requires_grad=False)
        layer.scales = nn.Parameter(torch.zeros(groups, layer.output_size, dtype=torch.float16),
                                    requires_grad=False)
        layer.awq_gptq_layout = False  # set by to_gptq_layout at load on CUDA

    def load_weight(self, layer: Linear, param_name: str, tensor: torch.Tensor, shard: int | None) -> None:
        what = f"{layer.prefix}.{param_name}" + ("" if shard is None else f"[shard {shard}]")
        if param_name in ("qweight", "qzeros"):
            start, size = shard_columns(layer, shard, PACK)
            copy_checked(getattr(layer, param_name).data[:, start:start + size], tensor, what)
        elif param_name == "scales":
            if tensor.dtype != layer.scales.dtype and layer.scales.dtype != torch.float32:
                layer.scales.data = layer.scales.data.float()  # keep bf16/fp32 scales exactly
            start, size = shard_columns(layer, shard)
            copy_checked(layer.scales.data[:, start:start + size], tensor.to(layer.scales.dtype), what)
        else:
            raise ValueError(f"{what}: an AWQ layer has qweight, qzeros, scales and bias, not {param_name!r}")

    def process_weights_after_loading(self, layer: Linear) -> None:
        layer.packed_int = None
        layer.awq_gptq_layout = False
        q, z, s = self.codes(layer, 0, layer.output_size)
        if repack_for_kernels(layer, q, z, s, self.group_size(layer), drop=("qzeros", "scales")):
            return
        if layer.device.type == "cuda" and layer.input_size % PACK == 0:
            to_gptq_layout(layer, q, z)

    def codes(self, layer: Linear, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Output columns start:end (multiples of 8) as (int codes [in, n], float32 zeros [G, n],
        float32 scales [G, n]), in natural column order."""
        cols = slice(start // PACK, end // PACK)
        if layer.awq_gptq_layout:
            q = unpack_int32(layer.qweight[:, start:end], 4, dim=0)
            z = unpack_int32(layer.qzeros[:, cols], 4, dim=1).float()
        else:
            q = unpack_int32(layer.qweight[:, cols], 4, dim=1, order=AWQ_REVERSE_ORDER)
            z = unpack_int32(layer.qzeros[:, cols], 4, dim=1, order=AWQ_REVERSE_ORDER).float()
        return q, z, layer.scales[:, start:end].float()

    def dequantize(self, layer: Linear, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        """W^T[:, start:end] ([in, end - start]) in `dtype`; `start`, `end` multiples of 8."""
        q, z, s = self.codes(layer, start, end)
        w = (q.view(s.shape[0], -1, end - start).float() - z[:, None]) * s[:, None]
        return w.view(layer.input_size, end - start).to(dtype)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.packed_int is not None:
            return packed_int.layer_forward(layer, x)
        flat = x.reshape(-1, x.shape[-1])
        if layer.awq_gptq_layout and runs_w4a16_triton(x, flat.shape[0]):
            from fw.quantizers.gptq_triton import w4a16_matmul  # imports triton: on the first CUDA call

            out = w4a16_matmul(flat, layer.qweight, layer.qzeros, layer.scales, self.group_size(layer), 0)
            out = out.view(*x.shape[:-1], layer.output_size)
            return out if layer.bias is None else out + layer.bias.to(out.dtype)
        out = x.new_empty(*x.shape[:-1], layer.output_size)
        grouped = x.dim() == 2 and x.shape[0] <= GROUPED_MAX_ROWS
        for a, b in column_blocks(layer.input_size, layer.output_size, PACK):
            if grouped:
                out[:, a:b] = grouped_matmul(x, *self.codes(layer, a, b))
            else:
                out[..., a:b] = x @ self.dequantize(layer, a, b, x.dtype)
        if layer.bias is not None:
            out += layer.bias.to(out.dtype)
        return out


def to_gptq_layout(layer: Linear, q: torch.Tensor, zeros: torch.Tensor) -> None:
    """Repacks an AWQ layer's codes [in, out] and zeros [G, out] (natural column order) into GPTQ's layout,
    which gptq_triton's kernel reads: qweight [in / 8, out], eight codes along the input per int32;
    qzeros [G, out / 8] in natural order. The same number of bytes; `codes` reads either layout."""
    layer.qweight = nn.Parameter(pack_int32(q, 4, dim=0), requires_grad=False)
    layer.qzeros = nn.Parameter(pack_int32(zeros.to(torch.int32), 4, dim=1), requires_grad=False)
    layer.awq_gptq_layout = True


@hookimpl
def fw_register_quantization_methods(register) -> None:
    register(QuantizationMethodSpec(
        name="awq",
        factory=AWQLinearMethod,
        detects=detects,
        devices=("cpu", "cuda"),
        verified_on=(Verified("cpu", by="fw's CPU tests"),  # on CUDA: tests/test_gpu_quantized.py
                     Verified("cuda", (9, 0), "NVIDIA H200", "2026-11-25", "scripts/gpu_acceptance.sh")),
        description="AWQ checkpoints, 4-bit GEMM layout (qweight/qzeros/scales, interleaved packing order), "
                    "asymmetric zeros, any group size; weights kept packed: fw's packed-int kernels on CPU, "
                    "gptq_triton's W4A16 kernel on CUDA at decode and small-batch sizes, else dequantized "
                    "block by block per matmul",
    ))
