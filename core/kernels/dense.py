"""Dense (unquantized) matrix products, with the weight in the fastest layout the device has.

Why: on AVX-512 CPUs torch's `F.linear` reaches well under the memory
bandwidth on bf16 matrix-vector products, which caps batch-1 decode. Two packed
layouts, chosen once at load (figures: docs/performance.md):

* bf16 on CPUs with AVX512-BF16: fw's own blocked layout and kernel
  (dense_bf16.cpp), which prefetches the next chunk of the weight while it
  computes: a decode step's weights stream from DRAM, and oneDNN's kernel
  waited on them (faster at decode sizes; prefill-sized products on a par
  with oneDNN).
* other fp32/bf16 CPUs: oneDNN's blocked layout (what inductor's freezing
  pass uses), faster than `F.linear` at batch 1.

Results differ from F.linear's only by the order of fp32 sums (see
docs/performance.md). Other devices keep the plain weight.
`FW_CPU_WEIGHT_PACKING=0` turns packing off and `=onednn` keeps bf16 on
oneDNN, to compare or to rule a layout out when chasing a numerical difference.
"""

from __future__ import annotations

import enum
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from fw import env
from fw.kernels.loader import DEFAULT_CFLAGS, register_fake, try_load_cpp_ops
from fw.kernels import weight_arena
from fw.kernels.hardware import this_cpu_flags

logger = logging.getLogger(__name__)

_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
BF16_SOURCE = Path(__file__).with_name("dense_bf16.cpp")  # package data
BF16_CFLAGS = DEFAULT_CFLAGS + ("-ffp-contract=off",)  # its SiLU rounds as cpu_ops.silu_mul does

# oneDNN's linear on a packed weight, as the resolved overload (the op packet resolves it on every call)
_linear_pointwise = getattr(getattr(torch.ops.mkldnn, "_linear_pointwise", None), "default", None)
_bf16_linear = None  # torch.ops.fw_dense.linear_bf16.default once built
_bf16_gated = None  # and its linear_bf16_gated
_bf16_state: bool | None = None  # None: not tried yet


def _packing_mode() -> str:
    """'off', 'onednn' (oneDNN for every dtype) or 'auto' (fw's bf16 kernel where it runs)."""
    return env.CPU_WEIGHT_PACKING.get()


def cpu_packing_available() -> bool:
    """oneDNN is built in and exposes the reorder/linear pair inductor uses."""
    if _packing_mode() == "off":
        return False
    mkldnn = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
            and hasattr(mkldnn, "_linear_pointwise"))


def bf16_kernel_wanted() -> bool:
    """This CPU has AVX512-BF16 and packing is not turned off or pinned to oneDNN."""

    return _packing_mode() == "auto" and "avx512_bf16" in this_cpu_flags()


def bf16_kernel_ready() -> bool:
    """fw's bf16 kernel is wanted and built (once per process, from the build cache when warm)."""
    global _bf16_state, _bf16_linear, _bf16_gated
    if not bf16_kernel_wanted():
        return False
    if _bf16_state is None:
        why = try_load_cpp_ops("dense_bf16", BF16_SOURCE, BF16_CFLAGS)
        if why is not None:
            logger.warning("fw's bf16 matmul kernel unavailable (%s); using oneDNN", why)
            _bf16_state = False
            return False
        _bf16_state = bool(torch.ops.fw_dense.available())
        _bf16_linear = torch.ops.fw_dense.linear_bf16.default
        _bf16_gated = torch.ops.fw_dense.linear_bf16_gated.default
        register_fake("fw_dense::linear_bf16", _linear_fake)
        register_fake("fw_dense::linear_bf16_gated", _gate_up_fake)
        register_fake("fw_dense::rows_bf16", _rows_fake)
    return _bf16_state


def _linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 fp32_out: bool = False) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32 if fp32_out else x.dtype)


def _gate_up_fake(x: torch.Tensor, weight: torch.Tensor, silu: bool) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[1] * (1 if silu else 2))


def _rows_fake(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return weight.new_empty(ids.shape[0], 2 * weight.shape[1])


def prepare(device: torch.device | str, dtype: torch.dtype) -> None:
    """Build fw's bf16 kernel ahead of the weights that will use it (the loader's C++-ops phase)."""
    if torch.device(device).type == "cpu" and dtype == torch.bfloat16:
        bf16_kernel_ready()


class DenseLayout(enum.Enum):
    """The layout `pack_dense` chose for a weight. Its owner records it at load and passes it to `linear`,
    `logits` and `silu_mul`: a layer never recognises a layout from a tensor's shape."""

    PLAIN = "plain"  # [out, in] as loaded: F.linear
    ONEDNN = "onednn"  # oneDNN's packed layout (an mkldnn tensor)
    BLOCKED = "blocked"  # fw's bf16 blocks, [N, K / 2, 2]
    GATE_UP = "gate_up"  # fw's bf16 blocks of a SiLU MLP's [gate; up], [2, I, K / 2, 2]: the SiLU can fuse


def pack_dense(weight: torch.Tensor, device: torch.device | str,
               gate_up: bool = False) -> tuple[torch.Tensor, DenseLayout]:
    """The weight [out, in] in the layout dense products run fastest with on `device` (where the model will
    run; weights load on the CPU first), and which layout that is: the input itself, PLAIN, where packing
    does not apply (another device, another dtype, packing off). A packed weight cannot move off the CPU.
    `gate_up`: the weight is [gate; up] of a SiLU MLP, which `silu_mul` may then fuse."""
    if torch.device(device).type != "cpu" or weight.device.type != "cpu":
        return weight, DenseLayout.PLAIN
    if weight.dtype not in _PACKABLE_DTYPES or weight.dim() != 2:
        return weight, DenseLayout.PLAIN
    if weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0 and bf16_kernel_ready():
        rows, cols = weight.shape  # written straight into the arena: pack_bf16's bytes, without a copy between
        packed = blocked_view(weight_arena.take(rows * cols * 2).view(torch.bfloat16), rows, cols, gate_up)
        pack_rows_into(packed, weight.detach(), 0)
        return packed, blocked_layout(rows, gate_up)
    if not cpu_packing_available():
        return weight, DenseLayout.PLAIN
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous()), DenseLayout.ONEDNN


def linear(x: torch.Tensor, weight: torch.Tensor, layout: DenseLayout,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ weight^T (+ bias) for a weight in `layout` (as `pack_dense` returned them)."""
    if layout is DenseLayout.BLOCKED:
        return _blocked(x, weight, bias, False)
    if layout is DenseLayout.GATE_UP:
        if bias is not None:
            raise ValueError("dense_linear: a weight packed with gate_up=True takes no bias")
        return _gate_up(x, weight, False)
    if layout is DenseLayout.ONEDNN:
        return _onednn(x, weight, bias)
    return F.linear(x, weight, bias)


def emit_linear(b, x, weight: torch.Tensor, layout: DenseLayout, bias: torch.Tensor | None = None):
    """`linear` as a step program's calls (fw.kernels.step_program) on a 2-D register x of the weight's dtype,
    as the layers' products are: the op `linear` calls for that case."""
    if layout is DenseLayout.BLOCKED:
        return b.call("fw_dense::linear_bf16", x, weight, bias, False)
    if layout is DenseLayout.GATE_UP:
        if bias is not None:
            raise ValueError("dense_linear: a weight packed with gate_up=True takes no bias")
        return b.call("fw_dense::linear_bf16_gated", x, weight, False)
    if layout is DenseLayout.ONEDNN and weight.is_mkldnn:  # its inputs are contiguous rows (a norm's, a product's)
        return b.call("mkldnn::_linear_pointwise", x, weight, bias, "none", [], "")
    return b.call("aten::linear", x, weight, bias)


def fuses_silu(layer) -> bool:
    """Whether a SiLU MLP's gate/up layer had its dense weight packed with the SiLU fused (`dense_silu_mul`)."""
    return layer.silu_gate_up and layer.dense_layout is DenseLayout.GATE_UP


def emit_silu_mul(b, x, weight: torch.Tensor):
    """`dense_silu_mul` as a step program's call."""
    return b.call("fw_dense::linear_bf16_gated", x, weight, True)


def logits(x: torch.Tensor, weight: torch.Tensor, layout: DenseLayout,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """`linear` for the output projection's logits: fw's bf16 kernel returns its fp32 sums unrounded; other
    layouts give the model dtype, as Hugging Face's models do (the engine casts them into a buffer it keeps
    across steps)."""
    if layout is DenseLayout.BLOCKED:
        return _blocked(x, weight, bias, True)
    return linear(x, weight, layout, bias)


def layout_of(weight: torch.Tensor) -> DenseLayout:
    """The layout of a weight `pack_dense_weight` returned, for callers of the one-argument API
    (`dense_linear`, `dense_logits`) that kept the tensor without `pack_dense`'s record: read from the
    tensor's rank and type. fw's own layers keep the record instead."""
    if weight.is_mkldnn:
        return DenseLayout.ONEDNN
    if is_blocked_bf16(weight):
        return DenseLayout.BLOCKED
    return DenseLayout.GATE_UP if is_gate_up_bf16(weight) else DenseLayout.PLAIN


def is_blocked_bf16(weight: torch.Tensor) -> bool:
    """`weight` is in fw's blocked bf16 layout, shaped [N, K / 2, 2] (a plain weight is 2-D)."""
    return weight.dim() == 3 and weight.dtype == torch.bfloat16 and weight.shape[2] == 2


def is_gate_up_bf16(weight: torch.Tensor) -> bool:
    """`weight` is a SiLU MLP's gate/up projection in fw's blocked bf16 layout for it, [2, I, K / 2, 2]."""
    return weight.dim() == 4 and weight.dtype == torch.bfloat16 and weight.shape[0] == 2 and weight.shape[3] == 2


def pack_dense_weight(weight: torch.Tensor, device: torch.device | str, gate_up: bool = False) -> torch.Tensor:
    """`pack_dense`'s weight alone (the stable plugin API's form; `dense_linear` reads its layout back)."""
    return pack_dense(weight, device, gate_up)[0]


_BLOCK = 48  # output columns per block of fw's bf16 layout (dense_bf16.cpp's NR); a SiLU gate/up block holds
_HALF = 24  # up to 24 gate outputs and the same up outputs (its HALF)


def blocked_bf16_buffer(rows: int, cols: int, device: torch.device | str) -> torch.Tensor | None:
    """Unwritten room in the weight arena for a bf16 [rows, cols] weight in fw's blocked layout, taken when
    the layer is built (so the weights lie in the model's order), or None where `pack_dense_weight` would
    not give a bf16 weight of that shape that layout on `device`. `blocked_view` shapes it once the layer
    knows whether it is a SiLU MLP's gate/up."""
    if torch.device(device).type != "cpu" or cols % 2 or not bf16_kernel_ready():
        return None
    return weight_arena.take(rows * cols * 2).view(torch.bfloat16)


def blocked_layout(rows: int, gate_up: bool) -> DenseLayout:
    """Which of fw's bf16 layouts a [rows, cols] weight takes: a gate/up one needs an even row count."""
    return DenseLayout.GATE_UP if gate_up and rows % 2 == 0 else DenseLayout.BLOCKED


def blocked_view(buffer: torch.Tensor, rows: int, cols: int, gate_up: bool) -> torch.Tensor:
    """`buffer` shaped as `pack_dense(weight [rows, cols], gate_up=gate_up)` returns it (`blocked_layout`)."""
    if blocked_layout(rows, gate_up) is DenseLayout.GATE_UP:
        return buffer.view(2, rows // 2, cols // 2, 2)
    return buffer.view(rows, cols // 2, 2)


def pack_rows_into(packed: torch.Tensor, rows: torch.Tensor, first: int) -> None:
    """Write rows [first, first + len(rows)) of a [N, K] weight into `packed` (a `blocked_view`): the bytes
    pack_bf16 (pack_bf16_gated for a 4-D view) writes for them. Why: a checkpoint's shards (q, k and v;
    gate and up) go from the memory-mapped file straight into the blocked layout, instead of into a
    plain weight first that is then packed and copied into the arena."""
    src = rows.to(torch.bfloat16).contiguous().view(torch.int32)  # [n, K / 2]: one input pair per word
    words = packed.view(-1).view(torch.int32)
    if packed.dim() == 4:  # rows [0, I) are gate outputs, [I, 2I) the same up outputs
        half = packed.shape[1]
        for part, lo in ((0, 0), (1, half)):
            a, b = max(first, lo), min(first + len(src), lo + half)
            if a < b:
                _scatter(words, src[a - first:b - first], a - lo, half, _HALF, part)
    else:
        _scatter(words, src, first, packed.shape[0], _BLOCK, None)


def blocked_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (1-D) of a bf16 weight [N, K] that `pack_dense_weight` laid out in blocks (not a gate/up), as
    [len(ids), K]. One C++ op: the same gather as tensor ops cost far more than the rows' bytes
    (docs/performance.md)."""
    return torch.ops.fw_dense.rows_bf16(packed, ids)


def _scatter(words: torch.Tensor, src: torch.Tensor, first: int, total: int, width: int, part: int | None) -> None:
    """Rows [first, first + len(src)) of `total` into blocks of `width` of them: block b's words are [K/2, cols]
    after b * K/2 * 48 words, cols = its rows (times 2 for a gate/up block, `part` 0 the gate's, 1 the up's)."""
    kp, end, pair = src.shape[1], first + len(src), part is not None

    def block(b: int) -> tuple[torch.Tensor, int]:  # (block b as [K/2, cols], first column of this part)
        h = min(width, total - b * width)
        start = b * kp * _BLOCK
        return words[start:start + kp * h * (2 if pair else 1)].view(kp, -1), (part * h if pair else 0)

    r = first
    while r < end:
        b, c = divmod(r, width)
        if c == 0 and r + width <= end:  # whole blocks in one copy
            n = (end - r) // width
            region = words[b * kp * _BLOCK:(b + n) * kp * _BLOCK]
            into = region.view(n, kp, 2, width)[:, :, part] if pair else region.view(n, kp, width)
            into.copy_(src[r - first:r - first + n * width].view(n, width, kp).transpose(1, 2))
            r += n * width
            continue
        count = min(width - c, end - r)
        into, col = block(b)
        into[:, col + c:col + c + count].copy_(src[r - first:r - first + count].t())
        r += count


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ weight^T (+ bias), for a weight from `pack_dense_weight` (packed or plain): the stable
    plugin API's form of `linear`, the layout read back with `layout_of`."""
    return linear(x, weight, layout_of(weight), bias)


def dense_silu_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu(x @ gate^T) * (x @ up^T) for a weight packed with `gate_up=True`, the activation computed
    from each block's sums before they leave the cache (what `cpu_ops.silu_mul` would compute from the
    bf16 product)."""
    return _gate_up(x, weight, True)


def _gate_up(x: torch.Tensor, weight: torch.Tensor, silu: bool) -> torch.Tensor:
    _check_input_dtype(x, weight)
    return _bf16_gated(x.reshape(-1, x.shape[-1]), weight, silu).view(*x.shape[:-1], -1)


def dense_logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`logits` for a weight from `pack_dense_weight`, the layout read back with `layout_of`."""
    return logits(x, weight, layout_of(weight), bias)


def _check_input_dtype(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dtype != weight.dtype:
        raise TypeError(f"dense_linear: input dtype {x.dtype} != weight dtype {weight.dtype}")


def _blocked(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fp32_out: bool) -> torch.Tensor:
    _check_input_dtype(x, weight)
    if x.dim() == 2:
        return _bf16_linear(x, weight, bias, fp32_out)
    out = _bf16_linear(x.reshape(-1, x.shape[-1]), weight, bias, fp32_out)
    return out.view(*x.shape[:-1], weight.shape[0])


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if not weight.is_mkldnn:  # kept from before the layout was recorded: torch.compile's traced graphs depend on it
        return F.linear(x, weight, bias)
    if x.dim() == 2 and x.is_contiguous() and x.dtype == weight.dtype:  # the hot path: one op
        return _linear_pointwise(x, weight, bias, "none", [], "")
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    if not flat.is_contiguous():
        flat = flat.contiguous()
    _check_input_dtype(flat, weight)
    out = _linear_pointwise(flat, weight, bias, "none", [], "")
    return out.view(*lead, out.shape[-1])
