"""Linear products on block-quantized weights kept packed: 4-bit (w = d * q + m, q in 0..15), 8-bit
(w = d * q) and fp8 e4m3 (w = s * code), blocks of 32 inputs, on CPUs with AVX512-VNNI and AVX512-BF16
(packed_int.cpp: layout and numerics).

Why one family: GGUF Q4_0/Q4_1, GPTQ and AWQ 4-bit are all 4-bit groups with a scale and a zero or min, and
GGUF Q8_0 and row-wise int8 are 8-bit blocks with a scale; a quantization method converts its format to
`QuantBlocks` once at load, `pack` lays it out for the kernel, and `packed_linear` runs it. The activations
are quantized to int8 per block of 32 inside the kernel (W8A8 and W4A8, as llama.cpp's CPU path). The int8
rounding alone costs ~0.5% of each product; each row's heavy blocks, the few holding outlier channels, which
carry most of that error, take a second int8 term with the first's rounding residual (figures in
docs/quantization.md). In one process the blocks are chosen by the row alone at any size, so a row's result
never depends on how many rows share the step: a greedy request answers the same alone, batched, or after a
cached prefix (tensor-parallel ranks: SLICE_HEAVY_MAX_ROWS). A second term everywhere would double the
integer work of the compute-bound large steps. fp8 weights
(`Fp8Blocks`) are widened exactly to bf16 in registers and multiplied with bf16 activations (W8A16); so are
int8 weights given as `WideInt8Blocks` (the same kernel with a table of integers), which bitsandbytes' int8
takes: faster than the 8-bit kernel at decode sizes, slower on large steps (docs/quantization.md).

A SiLU MLP's [gate; up] layer on one 4- or 8-bit weight applies the activation in the product (`silu_mul`),
as fw's dense bf16 kernel does, bit for bit what the product and `cpu_ops.silu_mul` give in turn.

`FW_CPU_PACKED_INT=0` turns the kernels off (methods keep their reference paths).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from fw import env
from fw.kernels.loader import DEFAULT_CFLAGS, register_fake, try_load_cpp_ops
from fw.kernels import weight_arena
from fw.kernels.hardware import this_cpu_flags
from fw.kernels.step_program import NotReplayable

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("packed_int.cpp")  # package data
CFLAGS = DEFAULT_CFLAGS + ("-ffp-contract=off",)  # its SiLU rounds as cpu_ops.silu_mul does
BLOCK = 32  # inputs per block
TILE = 16  # output rows per tile
RECORD_BYTES = {4: 320, 8: 576, "f8": 576, "i8": 576}  # bytes per (tile, block): codes, then scales and offsets or sums
_state: bool | None = None  # None: not tried yet
_f8_state = False  # the fp8 kernel is built too (AVX512-BF16 and -VBMI)
_OPS: dict[int | str, object] = {}  # bits (4, 8, "f8", "i8") -> torch.ops.fw_packed_int.linear_*.default once built
_SILU_OPS: dict[int, object] = {}  # bits (4, 8) -> torch.ops.fw_packed_int.silu_q*.default


@dataclass(frozen=True)
class QuantBlocks:
    """A weight [N, K] as codes and per-(row, block of 32) scales: w = scale * code (+ offset, 4-bit)."""

    bits: int  # 4: codes uint8 in 0..15 with an offset; 8: codes int8 in -127..127, no offset
    codes: torch.Tensor  # [N, K]
    scale: torch.Tensor  # [N, K / 32], fp16 or representable in it
    offset: torch.Tensor | None = None  # [N, K / 32] (4-bit)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: the reference the kernels are tested against."""
        n, k = self.codes.shape
        w = self.codes.float().view(n, k // BLOCK, BLOCK) * self.scale.half().float().unsqueeze(-1)
        if self.offset is not None:
            w += self.offset.half().float().unsqueeze(-1)
        return w.view(n, k)


@dataclass(frozen=True)
class Fp8Blocks:
    """A weight [N, K] as e4m3 codes and per-(row, block of 32) fp32 scales: w = scale * code."""

    codes: torch.Tensor  # [N, K], torch.float8_e4m3fn (int8 in WideInt8Blocks)
    scale: torch.Tensor  # [N, K / 32] float32

    bits = "f8"

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: the reference the kernel is tested against."""
        n, k = self.codes.shape
        return (self.codes.float().view(n, k // BLOCK, BLOCK) * self.scale.float().unsqueeze(-1)).view(n, k)


@dataclass(frozen=True)
class WideInt8Blocks(Fp8Blocks):
    """`Fp8Blocks` whose codes are int8 (-127..127): the f8 kernel widens them to bf16 in registers with a table
    of integers (W8A16: no activation rounding). `QuantBlocks(8, ...)` is the same weight for the W8A8 kernel."""

    bits = "i8"


@dataclass(frozen=True)
class PackedWeight:
    """A weight in the kernels' layout: `data` is uint8, rows x cols weights of `bits` bits (4, 8, "f8" or "i8")."""

    bits: int | str
    rows: int
    cols: int
    data: torch.Tensor


def cpu_kernels_enabled() -> bool:
    """`FW_CPU_PACKED_INT` is not 0: quantized weights may run on CPU kernels (fw's here, and a library's own
    fused kernel where a method uses one, as bitsandbytes' 4-bit); 0 keeps every method's reference path."""
    return env.CPU_PACKED_INT.get()


def wanted() -> bool:
    """This CPU has AVX512-VNNI and the kernels are not turned off."""

    if not cpu_kernels_enabled():
        return False
    return {"avx512_vnni", "avx512bw", "avx512vl", "f16c"} <= set(this_cpu_flags())


def ready() -> bool:
    """The kernels are wanted (read on every call) and built (once per process, from the build cache when warm)."""
    global _state
    if not wanted():
        return False
    if _state is None:
        why = try_load_cpp_ops("packed_int", SOURCE, CFLAGS)
        if why is not None:
            logger.warning("fw's packed int kernels unavailable (%s); quantized weights use the reference path", why)
            _state = False
            return False
        _state = bool(torch.ops.fw_packed_int.available())
        global _f8_state
        _f8_state = _state and bool(torch.ops.fw_packed_int.f8_available())
        ops = torch.ops.fw_packed_int  # the resolved overloads: the op packet resolves them on every call
        _OPS.update({4: ops.linear_q4.default, 8: ops.linear_q8.default, "f8": ops.linear_f8.default,
                     "i8": ops.linear_i8.default})
        _SILU_OPS.update({4: ops.silu_q4.default, 8: ops.silu_q8.default})
        for name in ("linear_q4", "linear_q8", "linear_f8", "linear_i8"):
            register_fake(f"fw_packed_int::{name}", _linear_fake)
        for name in ("silu_q4", "silu_q8"):
            register_fake(f"fw_packed_int::{name}", _silu_fake)
        for name in ("rows_q4", "rows_q8"):
            register_fake(f"fw_packed_int::{name}", _rows_fake)
    return _state


def _linear_fake(x: torch.Tensor, weight: torch.Tensor, rows: int, fp32_out: bool = False,
                 whole_row_squares: torch.Tensor | None = None, whole_row_blocks: int = 0) -> torch.Tensor:
    return x.new_empty(x.shape[0], rows, dtype=torch.float32 if fp32_out else x.dtype)


def _silu_fake(x: torch.Tensor, weight: torch.Tensor, rows: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], rows // 2)


def _rows_fake(weight: torch.Tensor, ids: torch.Tensor, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    return weight.new_empty(ids.shape[0], cols, dtype=dtype)


def applies(device: torch.device | str, cols: int, widening: bool = False) -> bool:
    """A weight of `cols` inputs that will run on `device` can be packed (and the kernels are here; with
    `widening`, the kernel that widens fp8 and `WideInt8Blocks` codes to bf16, which also needs AVX512-BF16 and
    AVX512-VBMI)."""
    return torch.device(device).type == "cpu" and cols % BLOCK == 0 and ready() and (_f8_state or not widening)


def _tiles(t: torch.Tensor) -> torch.Tensor:
    """[N, ...] padded with zero rows to a multiple of 16, viewed [N / 16, 16, ...]."""
    pad = -t.shape[0] % TILE
    if pad:
        t = torch.cat([t, t.new_zeros((pad, *t.shape[1:]))])
    return t.view(-1, TILE, *t.shape[1:])


def _half_bytes(v: torch.Tensor) -> torch.Tensor:
    """[N, KB] values as fp16 -> [NT, KB, 32] bytes (the tile's 16 rows side by side per block)."""
    return _tiles(v.to(torch.float16)).permute(0, 2, 1).contiguous().view(torch.uint8)




def concat(weights: list[PackedWeight]) -> tuple[torch.Tensor, list[PackedWeight]]:
    """The weights' bytes side by side in one arena tensor, and the weights as views of it: for a layer that
    keeps one parameter for several row groups."""
    if len(weights) == 1:
        return weights[0].data, weights
    flat = weight_arena.take(sum(w.data.numel() for w in weights))
    out, offset = [], 0
    for w in weights:
        view = flat[offset:offset + w.data.numel()]
        view.copy_(w.data)
        out.append(PackedWeight(w.bits, w.rows, w.cols, view))
        offset += w.data.numel()
    return flat, out


def pack(blocks: QuantBlocks | Fp8Blocks | WideInt8Blocks) -> PackedWeight:
    """`blocks` in the kernels' layout (packed_int.cpp), in the huge-page arena."""
    n, k = blocks.codes.shape
    if k % BLOCK:
        raise ValueError(f"packed weights need inputs in blocks of {BLOCK}; this weight has {k}")
    if blocks.bits == "i8" and bool((blocks.codes == -128).any()):
        raise ValueError("int8 weight codes must be in -127..127 (a code of -128 has no sign-magnitude form)")
    kb = k // BLOCK
    if blocks.bits == 4:
        q = _tiles(blocks.codes.to(torch.uint8)).view(-1, TILE, kb, 4, 2, 4)  # [tile, row, block, p, half, t]
        nibbles = q[..., 0, :] | (q[..., 1, :] << 4)  # [tile, row, block, p, t]
        codes = nibbles.permute(0, 2, 3, 1, 4).reshape(-1, kb, 256)
        record = torch.cat([codes, _half_bytes(blocks.scale), _half_bytes(blocks.offset)], dim=2)
    elif blocks.bits == 8:
        q = _tiles(blocks.codes.to(torch.int8)).view(-1, TILE, kb, 8, 4)  # [tile, row, block, quad, t]
        codes = q.permute(0, 2, 3, 1, 4).reshape(-1, kb, 512).view(torch.uint8)
        sums = q.sum(dim=(3, 4), dtype=torch.int32).to(torch.int16)  # [tile, row, block]: |sum| <= 4064
        correction = sums.permute(0, 2, 1).contiguous().view(torch.uint8)  # [tile, block, 32 bytes]
        record = torch.cat([codes, _half_bytes(blocks.scale), correction], dim=2)
    elif blocks.bits in ("f8", "i8"):
        raw = blocks.codes.view(torch.uint8)
        if blocks.bits == "i8":  # sign-magnitude, as e4m3 codes are: bit 7 the sign, bits 0..6 |q|
            raw = blocks.codes.abs().to(torch.uint8) | (blocks.codes < 0).to(torch.uint8) << 7
        # [tile, lane, row in lane, block, vector, half, t] -> [tile, block, vector, lane, half, row in lane, t]
        q = _tiles(raw).view(-1, 4, 4, kb, 8, 2, 2)
        codes = q.permute(0, 3, 4, 1, 5, 2, 6).reshape(-1, kb, 512)
        scale = _tiles(blocks.scale.float()).permute(0, 2, 1).contiguous().view(torch.uint8)
        record = torch.cat([codes, scale], dim=2)
    else:
        raise ValueError(f"no packed kernel for {blocks.bits}-bit weights")
    assert record.shape[-1] == RECORD_BYTES[blocks.bits]  # the record size packed_int.cpp reads
    data = weight_arena.take(record.numel())
    data.copy_(record.view(-1))
    return PackedWeight(blocks.bits, n, k, data)


def packed_linear(x: torch.Tensor, weights: list[PackedWeight], fp32_out: bool = False,
                  whole_rows=None) -> torch.Tensor:
    """x [..., K] times the packed weights stacked by rows (a fused layer may hold several formats).
    `whole_rows` (fw.layers.parallel.WholeRows): x holds one tensor-parallel rank's slice of each row."""
    if (len(weights) == 1 and x.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16)  # the decode step's case
            and not _needs_whole_rows(weights, x.shape[0], whole_rows)):
        w = weights[0]
        return _OPS[w.bits](x, w.data, w.rows, fp32_out)
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    if flat.dtype not in (torch.float32, torch.bfloat16):
        flat = flat.float()
    if _needs_whole_rows(weights, flat.shape[0], whole_rows):
        # heavy blocks (int weights, above SLICE_HEAVY_MAX_ROWS): chosen against the whole row's mean, as one process
        squares, blocks = whole_rows.sum(row_scale_squares(flat)), whole_rows.features // BLOCK
        outs = [_OPS[w.bits](flat, w.data, w.rows, fp32_out, squares, blocks) if w.bits in (4, 8) else
                _OPS[w.bits](flat, w.data, w.rows, fp32_out) for w in weights]
    else:
        outs = [_OPS[w.bits](flat, w.data, w.rows, fp32_out) for w in weights]
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    if not fp32_out and out.dtype != x.dtype:
        out = out.to(x.dtype)
    return out.view(*lead, out.shape[-1])


def layer_forward(layer, x: torch.Tensor) -> torch.Tensor:
    """A quantized `Linear` whose method repacked it (`layer.packed_int`): its product, in fp32 where the layer
    asks for it (an LM head), plus its bias. Every method on the kernels applies through here. A row-parallel
    layer (`layer.whole_rows`) passes what its rank needs to choose heavy blocks as one process would."""
    out = packed_linear(x, layer.packed_int, fp32_out=layer.fp32_out, whole_rows=getattr(layer, "whole_rows", None))
    return out if layer.bias is None else out + layer.bias


_OP_NAMES = {4: "fw_packed_int::linear_q4", 8: "fw_packed_int::linear_q8", "f8": "fw_packed_int::linear_f8",
             "i8": "fw_packed_int::linear_i8"}
_SILU_OP_NAMES = {4: "fw_packed_int::silu_q4", 8: "fw_packed_int::silu_q8"}


def fuses_silu(layer) -> bool:
    """A SiLU MLP's [gate; up] layer (`silu_gate_up`, off while a LoRA adapter is on it) whose product can apply
    the activation itself: one 4- or 8-bit packed weight with both halves in whole tiles, no bias, outputs in the
    activations' dtype, on one rank's whole rows (column-parallel layers always are)."""
    packed = getattr(layer, "packed_int", None)
    return (getattr(layer, "silu_gate_up", False) and packed is not None and len(packed) == 1
            and packed[0].bits in _SILU_OPS and packed[0].rows % (2 * TILE) == 0 and layer.bias is None
            and not layer.fp32_out and getattr(layer, "whole_rows", None) is None)


def silu_mul(layer, x: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up from the layer's product (`fuses_silu`), as `cpu_ops.silu_mul` computes it from the
    plain product's output, bit for bit; None where the layer does not fuse it or x is not float32/bfloat16."""
    if not fuses_silu(layer) or x.dtype not in (torch.float32, torch.bfloat16):
        return None
    w = layer.packed_int[0]
    flat = x.reshape(-1, x.shape[-1])
    return _SILU_OPS[w.bits](flat, w.data, w.rows).view(*x.shape[:-1], w.rows // 2)


def emit_silu(layer, b, x):
    """`silu_mul` as a step program's call; None where the layer does not fuse it."""
    if not fuses_silu(layer) or layer.params_dtype not in (torch.float32, torch.bfloat16):
        return None
    w = layer.packed_int[0]
    return b.call(_SILU_OP_NAMES[w.bits], x, w.data, w.rows)


def emit_layer(layer, b, x):
    """`layer_forward` as a step program's calls (fw.kernels.step_program): the one-weight case on one rank,
    which is the call `packed_linear` makes for the decode step's 2-D input."""
    if len(layer.packed_int) != 1:
        raise NotReplayable(f"{layer.prefix}: {len(layer.packed_int)} packed formats in one layer")
    if getattr(layer, "whole_rows", None) is not None:
        raise NotReplayable(f"{layer.prefix}: a tensor-parallel slice of the rows")
    if layer.params_dtype not in (torch.float32, torch.bfloat16):
        raise NotReplayable(f"{layer.prefix}: {layer.params_dtype} activations")
    w = layer.packed_int[0]
    out = b.call(_OP_NAMES[w.bits], x, w.data, w.rows, layer.fp32_out)
    return out if layer.bias is None else b.call("aten::add.Tensor", out, layer.bias)


class PackedIntSteps:
    """For a quantization method whose `apply` runs `layer_forward` on layers it repacked (`layer.packed_int`):
    its step program is that call (fw.layers.replay); its other layers are not replayed. Listed before
    LinearMethod in the method's bases."""

    def emit_step(self, layer, b, x):
        if getattr(layer, "packed_int", None) is None:
            raise NotReplayable(f"{layer.prefix}: {type(self).__name__} off fw's packed kernels")
        return emit_layer(layer, b, x)

    def silu_mul(self, layer, x):
        return silu_mul(layer, x)

    def emit_silu_step(self, layer, b, x):
        return emit_silu(layer, b, x)


HEAVY_FACTOR = 3.0  # packed_int.cpp's: a row's blocks with scale^2 >= this x the row's mean take the residual
# Up to this many rows a tensor-parallel rank chooses heavy blocks against its own slice of each row: an
# all-reduce of the whole rows' statistic before every row-parallel product slowed TP decode down more than
# it brought TP closer to one process, whose sums it differs from in their last bits anyway (figures in
# docs/distributed.md).
SLICE_HEAVY_MAX_ROWS = 8


def _needs_whole_rows(weights: list[PackedWeight], rows: int, whole_rows) -> bool:
    return whole_rows is not None and rows > SLICE_HEAVY_MAX_ROWS and any(w.bits in (4, 8) for w in weights)


def row_scale_squares(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> [M] float64: each row's sum over its blocks of the squared first-term scale (amax / 127 in
    float32, as the kernel computes it). Summed over the tensor-parallel ranks, it is the whole row's, whose
    mean decides the heavy blocks."""
    m, k = x.shape
    scale = x.float().view(m, k // BLOCK, BLOCK).abs().amax(-1) / 127
    return (scale.double() ** 2).sum(-1)


def quantize_activations(x: torch.Tensor, bits: int = 8, residual: bool = True) -> torch.Tensor:
    """x [M, K] as the kernels see it (float32): each block of 32 rounded to int8 codes times amax / 127. For
    int weights (4- and 8-bit) the rounding residual follows as a second term of int8 codes times amax / 32,258
    (the block then exact to ~amax / 64,516) in a row's heavy blocks, whose squared scale is at least HEAVY_FACTOR
    times the row's mean (the blocks of outlier channels, which carry most of one term's rounding error).
    `residual=False`: the first term alone."""
    m, k = x.shape
    blocks = x.float().view(m, k // BLOCK, BLOCK)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    terms = []
    seen, term_scale = torch.zeros_like(blocks), scale
    for _ in range(2 if residual and bits in (4, 8) else 1):
        inv = torch.where(term_scale > 0, 1 / term_scale, torch.zeros_like(term_scale))
        codes = ((blocks - seen) * inv).round().clamp(-127, 127)
        seen = seen + codes * term_scale
        terms.append(seen)
        term_scale = term_scale / 254
    if residual and bits in (4, 8):
        squared = scale.double() ** 2
        heavy = squared * (k // BLOCK) >= HEAVY_FACTOR * squared.sum(1, keepdim=True)
        seen = torch.where(heavy, terms[1], terms[0])
    return seen.view(m, k)


def reference_linear(x: torch.Tensor, blocks: QuantBlocks | Fp8Blocks | WideInt8Blocks) -> torch.Tensor:
    """The kernels' result computed plainly (float64): the activations as the kernel sees them (int8 blocks;
    bf16 for fp8 weights) times the dequantized weight. Tests hold the kernels to this within fp32 rounding,
    and to x @ W^T within the activations' rounding."""
    flat = x.reshape(-1, x.shape[-1])
    seen = flat.bfloat16() if blocks.bits in ("f8", "i8") else quantize_activations(flat, blocks.bits)
    return seen.double() @ blocks.dequantize().double().T
