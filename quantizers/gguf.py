"""The `gguf` quantization method: linear weights stay quantized in memory.

On CPUs with AVX512-VNNI, Q4_0, Q4_1, Q8_0 and Q4_K layers are repacked at load
into fw's packed-int kernels' layout (fw.kernels.packed_int: the codes and fp16
scales, activations quantized to int8 per block of 32 as llama.cpp does, in two
terms for 4-bit weights), and Q5_K and Q6_K layers are requantized onto its
8-bit grid (`requantized_int8`: a finer step than theirs; 9 bits a weight
against their 5.5 and 6.6, half of bf16's); a tied Q8_0 or Q6_K embedding
becomes the LM head that way too. Elsewhere,
and for the other types, the GGUF blocks are kept and dequantized per matmul in
plain torch (the reference path), unless the CPU default's `dense_fallback`
dequantizes such layers once at load. The block layouts follow llama.cpp's
ggml-quants.c as mirrored by the `gguf` library's numpy reference
(`gguf/quants.py`); each dequantizer here is vectorized over all blocks of a
layer. Types: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, and the float types F32, F16
and BF16 (which GGUF files use for small tensors).

A fused layer (q/k/v, gate/up) gets one packed tensor per checkpoint shard;
shards of the same type are concatenated row-wise (rows are independent), and
shards of different types (llama.cpp's Q4_K_M mixes Q4_K and Q6_K) are kept as
separate row groups, dequantized one after the other into one matrix.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fw.errors import ModelLoadError
from fw.layers import GGUFWeight, Linear, LinearMethod
from fw.kernels import dense, packed_int, packed_record
from fw.kernels.dense import DenseLayout
from fw.plugins import QuantizationMethodSpec, Verified, hookimpl

FW_PLUGIN_API_VERSION = "1.10"  # LinearMethod.silu_mul

logger = logging.getLogger(__name__)

QK_K = 256


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte `start` of every block, as float32 [n_blocks, 1]."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _field(blocks: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Bytes [start, stop) of every block, contiguous: elementwise ops on the strided slice itself run
    several times slower (short inner loops)."""
    return blocks[:, start:stop].contiguous()


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """Bytes in runs of `group`: each run's low nibbles, then its high nibbles (ggml's 4-bit order)."""
    n = qs.shape[0]
    qs = qs.reshape(n, -1, group)
    out = torch.empty(n, qs.shape[1], 2, group, dtype=torch.uint8, device=qs.device)
    torch.bitwise_and(qs, 0x0F, out=out[:, :, 0])
    torch.bitwise_right_shift(qs, 4, out=out[:, :, 1])
    return out.view(n, -1)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    w = _nibbles(_field(blocks, 2, 18), 16).float()
    return w.sub_(8).mul_(d)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    return _nibbles(_field(blocks, 4, 20), 16).float().mul_(d).add_(m)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return _field(blocks, 2, 34).view(torch.int8).float().mul_(_f16(blocks, 0))


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins packed in 12 bytes (Q4_K, Q5_K): get_scale_min_k4 in ggml."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.float(), mn.float()


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _k_scale_min(_field(blocks, 4, 16))
    q = _nibbles(_field(blocks, 16, 144), 32).view(n, 8, 32).float()
    return q.mul_((d * sc).reshape(n, 8, 1)).sub_((dmin * mn).reshape(n, 8, 1)).view(n, QK_K)


_BIT_SHIFTS = torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)
_CRUMB_SHIFTS = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _k_scale_min(_field(blocks, 4, 16))
    qh = _field(blocks, 16, 48).reshape(n, 1, 32)
    high = (qh >> _BIT_SHIFTS.to(blocks.device)) & 0x01  # bit j of qh[l] is the 5th bit of sub-block j, element l
    low = _nibbles(_field(blocks, 48, 176), 32).view(n, 8, 32)
    q = low.bitwise_or_(high << 4).float()
    return q.mul_((d * sc).reshape(n, 8, 1)).sub_((dmin * mn).reshape(n, 8, 1)).view(n, QK_K)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    low = _nibbles(_field(blocks, 0, 128), 64).view(n, 8, 32)
    qh = _field(blocks, 128, 192).reshape(n, 2, 1, 32)
    high = ((qh >> _CRUMB_SHIFTS.to(blocks.device)) & 0x03).reshape(n, 8, 32)
    q = low.bitwise_or_(high << 4).view(torch.int8).sub_(32).view(n, 16, 16).float()
    scales = _field(blocks, 192, 208).view(torch.int8).float()
    d = _f16(blocks, 208)
    return q.mul_((d * scales).reshape(n, 16, 1)).view(n, QK_K)


def _q4_0_blocks(blocks: torch.Tensor) -> packed_int.QuantBlocks:
    d = _f16(blocks, 0)
    return packed_int.QuantBlocks(4, _nibbles(_field(blocks, 2, 18), 16), d, d * -8)


def _q4_1_blocks(blocks: torch.Tensor) -> packed_int.QuantBlocks:
    return packed_int.QuantBlocks(4, _nibbles(_field(blocks, 4, 20), 16), _f16(blocks, 0), _f16(blocks, 2))


def _q8_0_blocks(blocks: torch.Tensor) -> packed_int.QuantBlocks:
    return packed_int.QuantBlocks(8, _field(blocks, 2, 34).view(torch.int8), _f16(blocks, 0))


def _q4_k_blocks(blocks: torch.Tensor) -> packed_int.QuantBlocks:
    """Q4_K's eight sub-blocks of 32 per super-block, each w = (d sc) q - (dmin m): the products d sc and
    dmin m rounded to fp16 (2^-12 of each, far below the 4-bit step)."""
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _k_scale_min(_field(blocks, 4, 16))
    return packed_int.QuantBlocks(4, _nibbles(_field(blocks, 16, 144), 32), (d * sc).half().float(),
                                  (dmin * mn).neg_().half().float())


def requantized_int8(w: torch.Tensor) -> packed_int.QuantBlocks:
    """float32 weights [n, k] (k a multiple of 32) on the 8-bit kernels' grid: per block of 32, the scale
    amax / 127 rounded up to fp16 and codes round(w / scale). For the K-quant types whose sub-blocks have no
    exact form there (Q5_K: 5-bit codes with a min; Q6_K: 16-weight sub-blocks): the 8-bit step is at most a
    quarter of theirs, so the rounding adds at most 1/16 to their own error's variance."""
    n, k = w.shape
    blocks = w.reshape(-1, packed_int.BLOCK)
    amax = blocks.abs().amax(dim=1)
    scale = (amax / 127).half()
    short = scale.float() * 127 < amax  # rounded down: the largest weight would need a code past 127
    scale = torch.where(short, torch.nextafter(scale, torch.full_like(scale, float("inf"))), scale).float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block: codes 0
    codes = torch.round(blocks / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return packed_int.QuantBlocks(8, codes.view(n, k), scale.view(n, k // packed_int.BLOCK))


def _q5_k_blocks(blocks: torch.Tensor) -> packed_int.QuantBlocks:
    return requantized_int8(_q5_k(blocks))


def _q6_k_blocks(blocks: torch.Tensor) -> packed_int.QuantBlocks:
    return requantized_int8(_q6_k(blocks))


# ggml types fw's packed-int kernels read (32-input blocks): exactly, but Q4_K's rounded sub-block scales and
# Q5_K's and Q6_K's requantization onto the 8-bit grid. ggml type id -> codes and scales
_PACKED_BLOCKS = {2: _q4_0_blocks, 3: _q4_1_blocks, 8: _q8_0_blocks, 12: _q4_k_blocks, 13: _q5_k_blocks,
                  14: _q6_k_blocks}


@dataclass(frozen=True)
class _BlockType:
    name: str
    block_size: int  # weights per block
    type_size: int  # bytes per block
    dequantize: Callable[[torch.Tensor], torch.Tensor]  # uint8 [n, type_size] -> float32 [n, block_size]


# ggml type ids (gguf.GGMLQuantizationType) -> layout
BLOCK_TYPES: dict[int, _BlockType] = {
    2: _BlockType("Q4_0", 32, 18, _q4_0),
    3: _BlockType("Q4_1", 32, 20, _q4_1),
    8: _BlockType("Q8_0", 32, 34, _q8_0),
    12: _BlockType("Q4_K", QK_K, 144, _q4_k),
    13: _BlockType("Q5_K", QK_K, 176, _q5_k),
    14: _BlockType("Q6_K", QK_K, 210, _q6_k),
}
FLOAT_TYPES: dict[int, torch.dtype] = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}


def dequantize_rows(data: torch.Tensor, kind: int | torch.dtype, cols: int) -> torch.Tensor:
    """Packed rows (uint8 [rows, bytes_per_row]) of ggml type `kind` (or raw `torch.dtype` bytes) to
    float [rows, cols]: float32 for block types, the stored dtype for float types."""
    rows = data.shape[0]
    if isinstance(kind, torch.dtype):
        return data.view(kind).reshape(rows, cols)
    if kind in FLOAT_TYPES:
        return data.view(FLOAT_TYPES[kind]).reshape(rows, cols)
    bt = BLOCK_TYPES[kind]
    return bt.dequantize(data.reshape(-1, bt.type_size)).reshape(rows, cols)


def supported_type_names() -> list[str]:
    return [bt.name for bt in BLOCK_TYPES.values()] + ["F32", "F16", "BF16"]


@dataclass(frozen=True)
class _Group:
    """Consecutive output rows stored in one format, at byte `offset` of the layer's packed weight."""
    kind: int | torch.dtype
    rows: int
    offset: int
    row_bytes: int


class GGUFLinearMethod(LinearMethod):
    """Keeps GGUF blocks as uint8 bytes (`layer.weight`, flat) plus their row groups (`layer.gguf_groups`).

    `dense_fallback` (the CPU default, where fw's packed-int kernels run): a layer whose types have no
    kernel there (K-quants, IQ*, Q5_0, float types) is dequantized at load into the dense layout instead,
    with one warning per type, as llama.cpp runs any file; named explicitly (`--quantization gguf`,
    `--no-gguf-dequantize-at-load`) such layers stay packed on the reference path."""

    keeps_gguf_blocks = True  # tells the GGUF loader to hand linear weights on packed (`GGUFWeight`)

    def __init__(self, dense_fallback: bool = False):
        self.dense_fallback = dense_fallback

    def create_weights(self, layer: Linear) -> None:
        layer.weight = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        layer.gguf_shards = {}
        layer.gguf_groups = []
        layer.packed_int = None  # the kernels' layout, when _repack chose it at load
        layer.dense = False  # dequantized at load by the dense fallback
        layer.dense_layout = DenseLayout.PLAIN  # and then packed in this layout (fw.kernels.dense)

    def load_weight(self, layer: Linear, param_name: str, tensor, shard: int | None) -> None:
        if param_name != "weight":
            raise ModelLoadError(f"{layer.prefix}.{param_name}: the gguf method has no parameter of that name")
        index = 0 if shard is None else shard
        rows = layer.output_sizes[index] if shard is not None else layer.output_size
        if isinstance(tensor, GGUFWeight) and self.dense_fallback and tensor.ggml_type not in BLOCK_TYPES \
                and tensor.ggml_type not in FLOAT_TYPES:
            tensor = _dequantize_any(tensor, layer.prefix)  # a type fw cannot keep packed: the gguf library's
        if isinstance(tensor, GGUFWeight):
            if tensor.ggml_type not in BLOCK_TYPES and tensor.ggml_type not in FLOAT_TYPES:
                raise ModelLoadError(
                    f"{layer.prefix}: GGUF tensor type {tensor.type_name} cannot be kept quantized (the gguf "
                    f"method reads {', '.join(supported_type_names())}); load the model with "
                    f"--gguf-dequantize-at-load")
            shape, kind, data = tensor.shape, tensor.ggml_type, tensor.data
        else:  # a dense tensor (say, from a transform that is not a row permutation): keep it as it is
            shape, kind = tuple(tensor.shape), layer.params_dtype
            data = tensor.to(layer.params_dtype).contiguous().view(torch.uint8).reshape(tensor.shape[0], -1)
        if tuple(shape) != (rows, layer.input_size):
            where = f"{layer.prefix}.weight" + ("" if shard is None else f"[shard {shard}]")
            raise ModelLoadError(f"{where}: checkpoint shape {tuple(shape)} != expected {(rows, layer.input_size)}")
        layer.gguf_shards[index] = (kind, data)

    def process_weights_after_loading(self, layer: Linear) -> None:
        shards = layer.gguf_shards
        if not shards:
            return  # nothing loaded: the loader's missing-weights check names the layer
        expected = len(layer.output_sizes)
        if len(shards) != expected and not (expected > 1 and len(shards) == 1 and set(shards) == {0}
                                            and shards[0][1].shape[0] == layer.output_size):
            missing = sorted(set(range(expected)) - set(shards))
            raise ModelLoadError(f"{layer.prefix}: the GGUF file lacks shard(s) {missing} of this fused layer")
        groups, parts, offset = [], [], 0
        for index in sorted(shards):
            kind, data = shards[index]
            if groups and groups[-1].kind == kind and groups[-1].row_bytes == data.shape[1]:
                last = groups[-1]
                groups[-1] = _Group(kind, last.rows + data.shape[0], last.offset, last.row_bytes)
            else:
                groups.append(_Group(kind, data.shape[0], offset, data.shape[1]))
            parts.append(data.reshape(-1))
            offset += data.numel()
        layer.weight = nn.Parameter(torch.cat(parts), requires_grad=False)
        layer.gguf_groups = groups
        layer.gguf_shards = {}
        layer.packed_int = self._repack(layer)
        if layer.packed_int is None and self.dense_fallback and packed_int.applies(layer.device, layer.input_size):
            self._to_dense(layer)

    def _to_dense(self, layer: Linear) -> None:
        """The layer dequantized into fw's dense layout (the kernels run dense weights faster than any
        per-matmul dequantization), saying once per type that it was."""
        for g in layer.gguf_groups:
            if not isinstance(g.kind, torch.dtype) and g.kind not in FLOAT_TYPES:
                _warn_dequantized_at_load(g.kind, layer.prefix)
        weight = self.dequantize(layer, layer.params_dtype)
        packed, layer.dense_layout = dense.pack_dense(weight, layer.device, gate_up=layer.silu_gate_up
                                                      and layer.bias is None)
        layer.weight = nn.Parameter(packed, requires_grad=False)
        layer.gguf_groups = []
        layer.dense = True

    @staticmethod
    def keeps_tied_head(ggml_type: int, device: torch.device, cols: int) -> bool:
        """A tied LM head stays in its GGUF blocks (the loader asks) where fw's packed-int kernels read them."""
        return ggml_type in _PACKED_BLOCKS and packed_int.applies(device, cols)

    def _repack(self, layer: Linear) -> list[packed_int.PackedWeight] | None:
        """The layer in fw's packed-int kernels' layout where every row group has one (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K,
        Q6_K) and
        the kernels run on the layer's device; the GGUF bytes are then dropped. None: the reference path."""
        if not (all(g.kind in _PACKED_BLOCKS for g in layer.gguf_groups)
                and packed_int.applies(layer.device, layer.input_size)):
            return None
        def repack() -> tuple[torch.Tensor, list[packed_int.PackedWeight]]:
            packed = []
            for g in layer.gguf_groups:
                data = layer.weight[g.offset:g.offset + g.rows * g.row_bytes].view(-1, BLOCK_TYPES[g.kind].type_size)
                blocks = _PACKED_BLOCKS[g.kind](data)
                packed.append(packed_int.pack(packed_int.QuantBlocks(
                    blocks.bits, blocks.codes.view(g.rows, -1), blocks.scale.view(g.rows, -1),
                    None if blocks.offset is None else blocks.offset.view(g.rows, -1))))
            return packed_int.concat(packed)

        groups = repr([(int(g.kind), g.rows, g.offset, g.row_bytes) for g in layer.gguf_groups])
        # the same blocks repack the same way: a warm load reads the record (fw.kernels.packed_record)
        flat, packed = packed_record.load_or_pack(layer.weight.data, groups, repack, code=(__file__,))
        layer.weight = nn.Parameter(flat, requires_grad=False)  # the groups' weights are views of it
        return packed

    def dequantize(self, layer: Linear, dtype: torch.dtype) -> torch.Tensor:
        """The full [out, in] weight in `dtype` (float32 arithmetic for block types)."""
        if layer.packed_int is not None:
            raise RuntimeError(f"{layer.prefix}: repacked for fw's packed-int kernels; the GGUF blocks are gone")
        flat = layer.weight
        mats = []
        for g in layer.gguf_groups:
            data = flat[g.offset:g.offset + g.rows * g.row_bytes].view(g.rows, g.row_bytes)
            mats.append(dequantize_rows(data, g.kind, layer.input_size).to(dtype))
        return mats[0] if len(mats) == 1 else torch.cat(mats)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.dense:
            product = dense.logits if layer.fp32_out else dense.linear
            return product(x, layer.weight, layer.dense_layout, layer.bias)
        if layer.packed_int is not None:
            return packed_int.layer_forward(layer, x)
        return F.linear(x, self.dequantize(layer, x.dtype), layer.bias)

    def silu_mul(self, layer: Linear, x: torch.Tensor) -> torch.Tensor | None:
        # fw's bf16 kernel fuses the activation where the dequantized weight was packed for it
        if layer.dense and dense.fuses_silu(layer):
            return dense.dense_silu_mul(x, layer.weight)
        return packed_int.silu_mul(layer, x)  # None off the packed kernels

    def emit_step(self, layer: Linear, b, x):
        if layer.dense and not layer.fp32_out:
            return dense.emit_linear(b, x, layer.weight, layer.dense_layout, layer.bias)
        if layer.packed_int is not None:
            return packed_int.emit_layer(layer, b, x)
        return super().emit_step(layer, b, x)  # dequantized per product: not replayed

    def emit_silu_step(self, layer: Linear, b, x):
        if layer.dense and dense.fuses_silu(layer):
            return dense.emit_silu_mul(b, x, layer.weight)
        return packed_int.emit_silu(layer, b, x)


_warned: set[int] = set()  # GGUF types already reported as dequantized at load, once per process


def _warn_dequantized_at_load(kind: int, prefix: str) -> None:
    """One warning per GGUF type (and process) that fw dequantizes at load for want of a packed kernel."""
    # here: the gguf library would cost every engine start 0.1 s (the plugins load with the manager)
    from gguf import GGMLQuantizationType

    if kind in _warned:
        return
    _warned.add(kind)
    try:
        name = GGMLQuantizationType(kind).name
    except ValueError:
        name = f"type {kind}"
    logger.warning("GGUF type %s has no packed kernel in fw: its layers are dequantized at load (%s first)",
                   name, prefix)


def _dequantize_any(tensor: GGUFWeight, prefix: str) -> torch.Tensor:
    """A packed weight of any ggml type, dequantized by the gguf library (float32 [rows, cols])."""
    # here: as in _warn_dequantized_at_load
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        array = dequantize(tensor.data.numpy(), GGMLQuantizationType(tensor.ggml_type))
    except Exception as exc:
        raise ModelLoadError(f"GGUF tensor type {tensor.type_name} could not be dequantized: {exc}") from None
    _warn_dequantized_at_load(tensor.ggml_type, prefix)
    return torch.from_numpy(np.ascontiguousarray(array).reshape(tensor.shape))


def _detects(quant_config: dict) -> bool:
    return str(quant_config.get("quant_method", "")).lower() == "gguf"


@hookimpl
def fw_register_quantization_methods(register) -> None:
    register(QuantizationMethodSpec(
        name="gguf",
        factory=lambda quant_config: GGUFLinearMethod(dense_fallback=bool(quant_config.get("dense_fallback"))),
        detects=_detects,
        devices=("cpu", "cuda"),
        verified_on=(Verified("cpu", by="fw's CPU tests"),  # on CUDA: tests/test_gpu_quantized.py
                     Verified("cuda", (9, 0), "NVIDIA H200", "2026-11-25", "scripts/gpu_acceptance.sh")),
        description="GGUF block formats (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) kept packed, dequantized per matmul",
    ))
