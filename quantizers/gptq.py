"""GPTQ checkpoints (`quant_method: "gptq"`), the reference path in plain torch.

On-disk format (AutoGPTQ / GPTQModel / transformers, per quantized linear with
in_features I, out_features O, pack = 32 // bits values per int32, G groups):

- `qweight` int32 [I / pack, O]: packed along the input dimension, value j of a
  word in bits [j*bits, (j+1)*bits).
- `qzeros` int32 [G, O / pack]: packed along the output dimension. GPTQ v1
  checkpoints (`checkpoint_format` "gptq" or absent) store zero - 1 (the kernels
  add the 1 back after unpacking); `checkpoint_format: "gptq_v2"` stores the zero.
- `scales` float [G, O]; `g_idx` int32 [I]: the group of each input channel
  (i // group_size, or a permutation of that with `desc_act`); `group_size: -1`
  is one group over the whole input.
- W[o, i] = scales[g_idx[i], o] * (q[i, o] - zero[g_idx[i], o]); `sym` only
  changed how the zeros were chosen, not this formula.

The weights stay packed in memory; each matmul dequantizes a block of output
columns at a time (fw.quantizers._packing.BLOCK_VALUES) and multiplies by it.
Fused fw layers (q/k/v, gate/up) concatenate each projection's tensors along
the output dimension; each projection keeps its own `g_idx` row, since act-order
permutations need not agree. The LM head stays in float unless the config says
`lm_head: true`; `modules_to_not_convert` is honoured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from fw.errors import ConfigError
from fw.layers import Linear, LinearMethod, UnquantizedLinearMethod
from fw.kernels import packed_int
from fw.plugins import QuantizationMethodSpec, Verified, hookimpl
from fw.quantizers._packing import (GROUPED_MAX_ROWS, check_bits, column_blocks, copy_checked, grouped_matmul,
                                    left_unquantized, repack_for_kernels, runs_w4a16_triton, shard_columns,
                                    unpack_int32)

FW_PLUGIN_API_VERSION = "1.2"  # verified_on

_FORMATS = {"gptq": 1, "gptq_v1": 1, "gptq_v2": 2}


@dataclass(frozen=True)
class GPTQConfig:
    bits: int
    group_size: int  # -1: one group over the whole input
    desc_act: bool
    sym: bool
    zero_offset: int  # added to the stored zeros: 1 for v1 checkpoints, 0 for v2
    lm_head: bool

    @classmethod
    def from_dict(cls, qcfg: dict) -> "GPTQConfig":
        if not qcfg:
            raise ConfigError("--quantization gptq loads GPTQ checkpoints; this checkpoint has no "
                              "quantization_config. Quantize on load with --quantization fp8 or "
                              "bitsandbytes-*, or use a GPTQ checkpoint")
        bits = check_bits("gptq", int(qcfg.get("bits", 4)), (2, 4, 8))
        group_size = int(qcfg.get("group_size", 128))
        if group_size == 0 or group_size < -1:
            raise ConfigError(f"gptq: group_size {group_size} is not valid (a positive size, or -1 for one group)")
        fmt = qcfg.get("checkpoint_format") or qcfg.get("format") or "gptq"
        if fmt not in _FORMATS:
            raise ConfigError(f"gptq: checkpoint_format {fmt!r} is not supported (supported: "
                              f"{', '.join(_FORMATS)}); convert the checkpoint to the gptq format")
        return cls(bits, group_size, bool(qcfg.get("desc_act", False)), bool(qcfg.get("sym", True)),
                   1 if _FORMATS[fmt] == 1 else 0, bool(qcfg.get("lm_head", False)))


def detects(qcfg: dict) -> bool:
    return str(qcfg.get("quant_method", "")).lower() == "gptq"


class GPTQLinearMethod(packed_int.PackedIntSteps, LinearMethod):
    """Packed GPTQ weights, dequantized block by block inside each matmul."""

    def __init__(self, quant_config: dict):
        self.quant_config = dict(quant_config)
        self.config = GPTQConfig.from_dict(self.quant_config)

    def method_for(self, prefix: str) -> LinearMethod:
        if left_unquantized(prefix, self.quant_config, self.config.lm_head):
            return UnquantizedLinearMethod()
        return self

    def num_groups(self, input_size: int) -> int:
        gs = self.config.group_size
        return 1 if gs == -1 else math.ceil(input_size / gs)

    def create_weights(self, layer: Linear) -> None:
        pack = 32 // self.config.bits
        if layer.input_size % pack:
            raise ValueError(f"{layer.prefix}: input size {layer.input_size} is not a multiple of {pack}, "
                             f"the {self.config.bits}-bit values packed per int32 of GPTQ's qweight")
        groups = self.num_groups(layer.input_size)
        out = layer.output_size
        if out % pack:
            raise ValueError(f"{layer.prefix}: output size {out} is not a multiple of {pack}, the "
                             f"{self.config.bits}-bit zeros packed per int32 of GPTQ's qzeros")
        layer.qweight = nn.Parameter(torch.zeros(layer.input_size // pack, out, dtype=torch.int32),
                                     requires_grad=False)
        layer.qzeros = nn.Parameter(torch.zeros(groups, out // pack, dtype=torch.int32),
                                    requires_grad=False)
        layer.scales = nn.Parameter(torch.zeros(groups, out, dtype=torch.float16), requires_grad=False)
        layer.g_idx = nn.Parameter(torch.zeros(len(layer.output_sizes), layer.input_size, dtype=torch.int32),
                                   requires_grad=False)

    def load_weight(self, layer: Linear, param_name: str, tensor: torch.Tensor, shard: int | None) -> None:
        pack = 32 // self.config.bits
        what = f"{layer.prefix}.{param_name}" + ("" if shard is None else f"[shard {shard}]")
        if param_name == "g_idx":
            rows = range(len(layer.output_sizes)) if shard is None else [shard]
            for row in rows:
                copy_checked(layer.g_idx.data[row], tensor.to(torch.int32), what)
            return
        if param_name == "qweight":
            start, size = shard_columns(layer, shard)
            copy_checked(layer.qweight.data[:, start:start + size], tensor, what)
        elif param_name == "qzeros":
            start, size = shard_columns(layer, shard, pack)
            copy_checked(layer.qzeros.data[:, start:start + size], tensor, what)
        elif param_name == "scales":
            if tensor.dtype != layer.scales.dtype and layer.scales.dtype != torch.float32:
                layer.scales.data = layer.scales.data.float()  # keep bf16/fp32 scales exactly
            start, size = shard_columns(layer, shard)
            copy_checked(layer.scales.data[:, start:start + size], tensor.to(layer.scales.dtype), what)
        else:
            raise ValueError(f"{what}: a GPTQ layer has qweight, qzeros, scales, g_idx and bias, "
                             f"not {param_name!r}")

    def process_weights_after_loading(self, layer: Linear) -> None:
        groups = layer.scales.shape[0]
        g_idx = layer.g_idx.data
        if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
            raise ValueError(f"{layer.prefix}.g_idx: group indices must lie in [0, {groups}), got "
                             f"{int(g_idx.min())}..{int(g_idx.max())}")
        # Contiguous groups (no act-order): dequantize by reshaping instead of gathering per row (when the
        # groups divide the input), and decode-sized matmuls run group by group on the codes.
        size = layer.input_size if self.config.group_size == -1 else self.config.group_size
        plain = torch.arange(layer.input_size, dtype=torch.int32) // size
        layer.gptq_contiguous = bool((g_idx == plain).all())
        layer.gptq_even = layer.gptq_contiguous and layer.input_size % size == 0
        layer.gptq_group_size = size
        layer.gptq_shared_g_idx = bool((g_idx == g_idx[:1]).all())
        layer.packed_int = None
        if self.config.bits == 4 and layer.gptq_contiguous:  # act-order layers keep the reference path
            q, z, s = self.codes(layer, 0, layer.output_size)
            repack_for_kernels(layer, q, z, s, size, drop=("qzeros", "scales", "g_idx"))

    def codes(self, layer: Linear, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Output columns start:end as (int codes [in, n], float32 zeros [G, n], float32 scales [G, n])."""
        bits, pack = self.config.bits, 32 // self.config.bits
        q = unpack_int32(layer.qweight[:, start:end], bits, dim=0)
        z = unpack_int32(layer.qzeros[:, start // pack:end // pack], bits, dim=1)
        return q, (z + self.config.zero_offset).float(), layer.scales[:, start:end].float()

    def dequantize(self, layer: Linear, start: int, end: int, g_idx: torch.Tensor | None,
                   dtype: torch.dtype) -> torch.Tensor:
        """W^T[:, start:end] ([in, end - start]) in `dtype`; `start`, `end` multiples of the pack size."""
        q, z, s = self.codes(layer, start, end)
        if g_idx is None:  # contiguous groups
            groups = s.shape[0]
            w = (q.view(groups, -1, end - start).float() - z[:, None]) * s[:, None]
            return w.view(layer.input_size, end - start).to(dtype)
        g = g_idx.long()
        return ((q.float() - z[g]) * s[g]).to(dtype)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.packed_int is not None:
            return packed_int.layer_forward(layer, x)
        flat = x.reshape(-1, x.shape[-1])
        if self.config.bits == 4 and layer.gptq_contiguous and runs_w4a16_triton(x, flat.shape[0]):
            from fw.quantizers.gptq_triton import w4a16_matmul  # imports triton: on the first CUDA call

            out = w4a16_matmul(flat, layer.qweight, layer.qzeros, layer.scales, layer.gptq_group_size,
                               self.config.zero_offset).view(*x.shape[:-1], layer.output_size)
            return out if layer.bias is None else out + layer.bias.to(out.dtype)
        pack = 32 // self.config.bits
        out = x.new_empty(*x.shape[:-1], layer.output_size)
        if layer.gptq_contiguous or layer.gptq_shared_g_idx:
            spans = [(0, layer.output_size, None if layer.gptq_even else layer.g_idx[0])]
        else:
            spans, start = [], 0
            for i, size in enumerate(layer.output_sizes):
                spans.append((start, start + size, layer.g_idx[i]))
                start += size
        grouped = layer.gptq_contiguous and x.dim() == 2 and x.shape[0] <= GROUPED_MAX_ROWS
        for lo, hi, g_idx in spans:
            for a, b in column_blocks(layer.input_size, hi - lo, pack):
                if grouped:
                    q, z, s = self.codes(layer, lo + a, lo + b)
                    out[:, lo + a:lo + b] = grouped_matmul(x, q, z, s, layer.gptq_group_size)
                else:
                    out[..., lo + a:lo + b] = x @ self.dequantize(layer, lo + a, lo + b, g_idx, x.dtype)
        if layer.bias is not None:
            out += layer.bias.to(out.dtype)
        return out


@hookimpl
def fw_register_quantization_methods(register) -> None:
    register(QuantizationMethodSpec(
        name="gptq",
        factory=GPTQLinearMethod,
        detects=detects,
        devices=("cpu", "cuda"),
        verified_on=(Verified("cpu", by="fw's CPU tests"),  # on CUDA: tests/test_gpu_quantized.py
                     Verified("cuda", (9, 0), "NVIDIA H200", "2026-11-25", "scripts/gpu_acceptance.sh")),
        description="GPTQ checkpoints: 2/4/8-bit qweight/qzeros/scales/g_idx, any group size (-1 too), "
                    "desc_act, sym and asym, v1 and v2 zero conventions; weights kept packed: fw's packed-int "
                    "kernels on CPU (4-bit, contiguous groups), gptq_triton's W4A16 kernel on CUDA at decode "
                    "and small-batch sizes, else dequantized block by block per matmul",
    ))
