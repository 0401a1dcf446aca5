"""The `fp8` quantization method (OCP e4m3, `torch.float8_e4m3fn`).

Three ways in, one layout in memory: an fp8 weight [out, in] (1 byte a parameter) and fp32 scales.
- `--quantization fp8` on a bf16/fp32 checkpoint: each output row is quantized as it loads, with its own
  scale amax(|row|) / 448 (per-output-channel), so the dense matrix never exists in full.
- `quant_method: "fp8"` checkpoints (AutoFP8 / vLLM / HF FineGrainedFP8): fp8 `weight` + `weight_scale`
  (a scalar per tensor, one per output channel, or one per `weight_block_size` block) and, for static
  activation schemes, a scalar `input_scale`.
- compressed-tensors float8 (`quant_method: "compressed-tensors"`, a config group with 8-bit float
  weights, strategy tensor / channel / block): the same tensors under the same names.

A per-tensor scale becomes per-row at load (each fused shard keeps its own), so one apply path serves all
but block-wise scales. The reference path is weight-only, on any device: the fp8 weight converted (exactly)
to the activation dtype, a plain matmul, and the per-row scale applied to the output; block-wise weights are
dequantized (weight * block scale) before the matmul. On CUDA devices with fp8 tensor cores and row-wise scaled
matmul (sm90+) activations are quantized per token on the fly and `torch._scaled_mm` runs the product;
a checkpoint's static `input_scale` is kept but not used for that (dynamic per-token scales are at least
as accurate). `lm_head` and the layers a checkpoint lists as ignored stay unquantized.
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F
from torch import nn

from fw.errors import UnsupportedConfigurationError
from fw.layers import Linear
from fw.kernels import packed_int
from fw.layers.linear import LinearMethod, UnquantizedLinearMethod
from fw.plugins import QuantizationMethodSpec, Verified, hookimpl
from fw.quantizers._packing import is_lm_head, skipped_in_checkpoint

FW_PLUGIN_API_VERSION = "1.2"  # verified_on

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
_MIN_SCALE = 1e-12  # an all-zero row gets this scale instead of 0 (0 / 0 would be NaN)


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (fp8 [out, in], fp32 scale [out]) with weight ~= fp8 * scale per row."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp_(min=_MIN_SCALE)
    q = (w / scale.unsqueeze(1)).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


_TABLES: dict[torch.dtype, torch.Tensor] = {}  # dtype -> the 256 e4m3 values in that dtype


def fp8_to(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An e4m3 tensor converted (exactly) to `dtype`. On CPU torch converts fp8 one element at a time,
    slower than the bf16 matrix-vector product it feeds; a 256-entry table indexed by the raw bytes is
    faster (docs/performance.md)."""
    if weight.device.type != "cpu":
        return weight.to(dtype)
    table = _TABLES.get(dtype)
    if table is None:
        table = _TABLES[dtype] = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).to(dtype)
    index = weight.view(torch.uint8).reshape(-1).to(torch.int32)
    return table.index_select(0, index).view(weight.shape)


def is_fp8_config(qcfg: dict) -> bool:
    """Whether a checkpoint's `quantization_config` is in a layout this method reads."""
    method = str(qcfg.get("quant_method", "")).lower()
    if method == "fp8":
        return True
    return method == "compressed-tensors" and _compressed_tensors_group(qcfg) is not None


def _compressed_tensors_group(qcfg: dict) -> dict | None:
    """The compressed-tensors config group with 8-bit float weights, or None."""
    for group in (qcfg.get("config_groups") or {}).values():
        weights = (group or {}).get("weights") or {}
        if weights.get("type") == "float" and int(weights.get("num_bits", 0)) == 8:
            return group
    return None


class Fp8LinearMethod(packed_int.PackedIntSteps, LinearMethod):
    """fp8 weights with per-row (or per-block) fp32 scales; see the module docstring.

    `prequantized`: the checkpoint holds fp8 tensors and scales (else dense weights are quantized on load).
    `block`: (rows, cols) of a block-wise scale, or None. `static_input`: the checkpoint has `input_scale`.
    `ignore`: module name patterns that stay unquantized."""

    def __init__(self, prequantized: bool, block: tuple[int, int] | None = None, static_input: bool = False,
                 ignore: tuple[str, ...] = ()):
        self.prequantized = prequantized
        self.block = block
        self.static_input = static_input
        self.ignore = ignore

    # -- which layers -----------------------------------------------------------------------------

    def method_for(self, prefix: str) -> LinearMethod:
        if skipped_in_checkpoint(prefix, lambda name: is_lm_head(name) or any(_matches(p, name) for p in self.ignore)):
            return UnquantizedLinearMethod()
        return self

    # -- parameters -------------------------------------------------------------------------------

    def create_weights(self, layer: Linear) -> None:
        out, inp = layer.output_size, layer.input_size
        layer.weight = nn.Parameter(torch.empty(out, inp, dtype=FP8), requires_grad=False)
        if self.block is not None:
            b0, b1 = self.block
            bad = [s for s in layer.output_sizes if s % b0]
            if bad:
                raise UnsupportedConfigurationError(
                    f"{layer.prefix}: fp8 weight_block_size {list(self.block)} does not divide its output "
                    f"shard sizes {layer.output_sizes}; such a checkpoint cannot be loaded")
            scale = torch.ones(out // b0, math.ceil(inp / b1), dtype=torch.float32)
        else:
            scale = torch.ones(out, dtype=torch.float32)
        if self.prequantized:  # a checkpoint tensor: the loader checks every parameter got one
            layer.weight_scale = nn.Parameter(scale, requires_grad=False)
        else:  # computed here: a buffer, which the loader does not expect from the checkpoint
            layer.register_buffer("weight_scale", scale)
        if self.static_input:
            layer.input_scale = nn.Parameter(torch.ones(len(layer.output_sizes), dtype=torch.float32),
                                             requires_grad=False)

    def load_weight(self, layer: Linear, param_name: str, tensor: torch.Tensor, shard: int | None) -> None:
        start, size = _rows(layer, shard)
        if param_name == "weight":
            if tensor.dtype == FP8:
                q, scale = tensor, None
            elif tensor.dtype.is_floating_point and tensor.element_size() == 1:
                raise UnsupportedConfigurationError(
                    f"{layer.prefix}.weight is {tensor.dtype}; the fp8 method reads float8_e4m3fn weights only")
            elif self.prequantized:
                raise UnsupportedConfigurationError(
                    f"{layer.prefix}.weight is {tensor.dtype} in a checkpoint marked fp8; expected float8_e4m3fn "
                    f"(list the layer in the config's ignored layers if it is meant to stay unquantized)")
            else:
                q, scale = quantize_rows(tensor)
            _check(layer, "weight", tensor.shape, (size, layer.input_size))
            layer.weight.data.narrow(0, start, size).copy_(q)
            if scale is not None:
                layer.weight_scale.data.narrow(0, start, size).copy_(scale)
        elif param_name == "weight_scale":
            self._load_scale(layer, tensor.float(), start, size)
        elif param_name == "input_scale":
            layer.input_scale.data[shard or 0] = tensor.float().reshape(-1).max()
        else:
            raise UnsupportedConfigurationError(f"{layer.prefix}.{param_name}: not a tensor of an fp8 layer")

    def _load_scale(self, layer: Linear, scale: torch.Tensor, start: int, size: int) -> None:
        target = layer.weight_scale.data
        if self.block is not None:
            b0 = self.block[0]
            rows = target.narrow(0, start // b0, size // b0)
            _check(layer, "weight_scale", scale.shape, tuple(rows.shape))
            rows.copy_(scale)
            return
        if scale.numel() == 1:  # per tensor: every row of this shard
            target.narrow(0, start, size).fill_(scale.reshape(()).item())
            return
        _check(layer, "weight_scale", (scale.numel(),), (size,))  # per channel: [out] or [out, 1]
        target.narrow(0, start, size).copy_(scale.reshape(-1))

    def process_weights_after_loading(self, layer: Linear) -> None:
        """A bf16 model on a CPU with fw's packed kernels: the e4m3 codes and their scales (one per row and
        block of 32 inputs) in the kernels' f8 layout, replacing the plain fp8 matrix. The kernel widens the
        codes to bf16 in registers and multiplies them with bf16 activations, exactly as the reference path
        does in bf16; an fp32 model keeps the reference path (the kernel would round its activations)."""
        layer.packed_int = None
        kb = layer.input_size // packed_int.BLOCK
        if self.block is not None and self.block[1] % packed_int.BLOCK:
            return  # a scale block that splits a block of 32 inputs: the reference path
        if layer.params_dtype != torch.bfloat16 or not packed_int.applies(layer.device, layer.input_size, widening=True):
            return
        scale = self._scales(layer)[:, :: packed_int.BLOCK][:, :kb]
        weight = packed_int.pack(packed_int.Fp8Blocks(layer.weight.data, scale))
        layer.weight = nn.Parameter(weight.data, requires_grad=False)
        layer.packed_int = [weight]

    # -- running ----------------------------------------------------------------------------------

    def _scales(self, layer: Linear) -> torch.Tensor:
        """The fp32 scale of every weight [out, in] (per row, or per block of a block-wise checkpoint)."""
        scale, (out, inp) = layer.weight_scale.float(), (layer.output_size, layer.input_size)
        if self.block is None:
            return scale.unsqueeze(1).expand(out, inp)
        b0, b1 = self.block
        return scale.repeat_interleave(b0, 0).repeat_interleave(b1, 1)[:, :inp]

    def dequantized(self, layer: Linear, dtype: torch.dtype) -> torch.Tensor:
        """The weight as `dtype` [out, in]: fp8 value times its scale, computed in fp32."""
        if getattr(layer, "packed_int", None) is not None:
            raise RuntimeError(f"{layer.prefix}: repacked for fw's packed kernels; the fp8 matrix is gone")
        w = fp8_to(layer.weight, torch.float32).mul_(self._scales(layer))
        return w if dtype == torch.float32 else w.to(dtype)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if getattr(layer, "packed_int", None) is not None:
            return packed_int.layer_forward(layer, x)
        if self.block is not None:
            return F.linear(x, self.dequantized(layer, x.dtype), layer.bias)
        if _scaled_mm_usable(x, layer.weight):
            return _fp8_matmul(x, layer.weight, layer.weight_scale, layer.bias)
        # A per-row scale factors out of the row's dot product: y = (x @ q^T) * scale. fp8 converts exactly
        # to bf16/fp16/fp32, so this costs one conversion pass instead of dequantizing in fp32 and rounding.
        out = F.linear(x, fp8_to(layer.weight, x.dtype)).mul_(layer.weight_scale)
        return out if layer.bias is None else out.add_(layer.bias)

    def weight_bytes(self, layer: Linear) -> int:
        tensors = [*layer.parameters(recurse=False), *layer.buffers(recurse=False)]
        return sum(t.numel() * t.element_size() for t in tensors)


def _rows(layer: Linear, shard: int | None) -> tuple[int, int]:
    if shard is None:
        return 0, layer.output_size
    return sum(layer.output_sizes[:shard]), layer.output_sizes[shard]


def _check(layer: Linear, name: str, got, want) -> None:
    if tuple(got) != tuple(want):
        raise ValueError(f"{layer.prefix}.{name}: checkpoint shape {tuple(got)} != expected {tuple(want)}")


def _matches(pattern: str, prefix: str) -> bool:
    """compressed-tensors `ignore` entries are module names or `re:` regexes; others plain names."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], prefix) is not None
    return prefix == pattern or prefix.endswith("." + pattern)


def _scaled_mm_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """fp8 tensor-core matmul with row-wise scales: CUDA sm90+, a torch that has `_scaled_mm`, bf16
    activations (row-wise scaling writes bf16 only) and both matrix dims multiples of 16 (cuBLASLt's
    fp8 alignment). Anything else takes the weight-only path."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_scaled_mm")
            and torch.cuda.get_device_capability(x.device) >= (9, 0)
            and x.shape[-1] % 16 == 0 and weight.shape[0] % 16 == 0)


def _fp8_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """x quantized per token (row) to fp8, times the fp8 weight, both scales applied by `_scaled_mm`."""
    lead, flat = x.shape[:-1], x.reshape(-1, x.shape[-1])
    x_scale = (flat.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp_(min=_MIN_SCALE)
    xq = (flat.float() / x_scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1).float(),
                           out_dtype=torch.bfloat16)
    if bias is not None:  # added after: row-wise scaled products take no bias in every torch release
        out = out.add_(bias)
    return out.view(*lead, out.shape[-1])


def make_method(qcfg: dict) -> Fp8LinearMethod:
    """The method for a checkpoint's quantization_config ({} for a dense checkpoint under --quantization fp8)."""
    method = str(qcfg.get("quant_method", "")).lower() if qcfg else ""
    if not method:
        return Fp8LinearMethod(prequantized=False)
    if method == "fp8":
        fmt = str(qcfg.get("fmt", "e4m3")).lower()
        if fmt != "e4m3":
            raise UnsupportedConfigurationError(f"fp8 checkpoint format {fmt!r} is not supported; fw reads e4m3")
        block = qcfg.get("weight_block_size")
        ignore = tuple(qcfg.get("ignored_layers") or ()) + tuple(qcfg.get("modules_to_not_convert") or ())
        return Fp8LinearMethod(True, tuple(block) if block else None,
                               static_input=qcfg.get("activation_scheme") == "static", ignore=ignore)
    group = _compressed_tensors_group(qcfg) if method == "compressed-tensors" else None
    if group is None:
        raise UnsupportedConfigurationError(
            f"--quantization fp8 cannot re-quantize a checkpoint already quantized with {method!r}; "
            f"drop --quantization to load it with its own method")
    weights = group["weights"]
    strategy = weights.get("strategy", "tensor")
    if strategy not in ("tensor", "channel", "block") or not weights.get("symmetric", True):
        raise UnsupportedConfigurationError(
            f"compressed-tensors float8 weights with strategy {strategy!r} "
            f"(symmetric={weights.get('symmetric', True)}) are not supported; fw reads symmetric tensor, channel "
            f"and block scales")
    block = tuple(weights["block_structure"]) if strategy == "block" else None
    acts = group.get("input_activations") or {}
    static = bool(acts) and not acts.get("dynamic", True)
    return Fp8LinearMethod(True, block, static_input=static, ignore=tuple(qcfg.get("ignore") or ()))


@hookimpl
def fw_register_quantization_methods(register) -> None:
    register(QuantizationMethodSpec(
        name="fp8",
        factory=make_method,
        detects=is_fp8_config,
        devices=("cpu", "cuda"),
        verified_on=(Verified("cpu", by="fw's CPU tests"),  # on CUDA: tests/test_gpu_quantized.py
                     Verified("cuda", (9, 0), "NVIDIA H200", "2026-11-25", "scripts/gpu_acceptance.sh")),
        description="fp8 e4m3 weights with per-channel/per-tensor/block scales: quantize on load or read "
                    "fp8 / compressed-tensors float8 checkpoints (weight-only dequantize; fp8 matmul on sm90+)",
    ))
