"""Unpacking the int32-packed integer weights GPTQ and AWQ checkpoints store, and
helpers their fused-layer loading and block-wise matmuls share.

Both formats put 32 // bits values in each int32, the first value in the lowest
bits; they differ in the packed dimension (GPTQ: input rows of `qweight`,
output columns of `qzeros`; AWQ: output columns of both) and in AWQ's
interleaved order of the values inside one int32."""

from __future__ import annotations

import importlib.util
from typing import Callable

import torch

from fw.errors import ConfigError, ModelLoadError
from fw.layers import FUSED_PROJECTIONS
from fw.kernels import packed_int

# AWQ's GEMM kernels pack output columns c*8 + [0, 2, 4, 6, 1, 3, 5, 7] into nibbles 0..7 of
# int32 column c; nibble AWQ_REVERSE_ORDER[j] therefore holds column c*8 + j.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)

# Output columns dequantized at once per matmul: bounds the transient float copy of a weight
# (4M values = 16 MB in fp32) however large the layer is.
BLOCK_VALUES = 1 << 22


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 values packed along `dim` -> one int32 value per element (unsigned, < 2**bits).

    `order[j]` is the slot (counted from the lowest bits) that holds value j of each group;
    None means slot j holds value j."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    if order is not None:
        shifts = shifts[list(order)]
    dim = dim % packed.dim()
    shape = [1] * (packed.dim() + 1)
    shape[dim + 1] = per_word
    values = (packed.unsqueeze(dim + 1) >> shifts.view(shape)) & ((1 << bits) - 1)
    new_shape = list(packed.shape)
    new_shape[dim] *= per_word
    return values.reshape(new_shape)


def pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The inverse of `unpack_int32` in the natural order: values (< 2**bits) packed along `dim`, whose size
    must be a multiple of 32 // bits."""
    per_word = 32 // bits
    dim = dim % values.dim()
    if values.shape[dim] % per_word:
        raise ValueError(f"pack_int32: dimension {dim} has {values.shape[dim]} values, not a multiple of {per_word}")
    shape = list(values.shape)
    shape[dim:dim + 1] = [shape[dim] // per_word, per_word]
    grouped = values.to(torch.int32).reshape(shape)
    packed = torch.zeros(shape[:dim + 1] + shape[dim + 2:], dtype=torch.int32, device=values.device)
    for j in range(per_word):
        packed |= grouped.select(dim + 1, j) << (bits * j)
    return packed


def check_bits(method: str, bits: int, allowed: tuple[int, ...]) -> int:
    if bits not in allowed:
        raise ConfigError(f"{method}: {bits}-bit weights are not supported (supported: "
                          f"{', '.join(map(str, allowed))}); use a checkpoint quantized with one of those")
    return bits


def shard_columns(layer, shard: int | None, per_word: int = 1) -> tuple[int, int]:
    """(start, size) of a fused layer's output shard, in units of `per_word` output columns.

    Raises when a shard boundary would split one packed int32 between two projections."""
    if shard is None:
        start, size = 0, layer.output_size
    else:
        start, size = sum(layer.output_sizes[:shard]), layer.output_sizes[shard]
    if start % per_word or size % per_word:
        raise ValueError(f"{layer.prefix}: output shard {shard} (columns {start}..{start + size}) is not a "
                         f"multiple of the {per_word} values packed per int32, so its packed tensors cannot be "
                         f"placed in the fused layer")
    return start // per_word, size // per_word


def copy_checked(target: torch.Tensor, tensor: torch.Tensor, what: str) -> None:
    if target.shape != tensor.shape:
        raise ValueError(f"{what}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(target.shape)}")
    target.copy_(tensor)


def column_blocks(rows: int, columns: int, multiple: int = 1) -> list[tuple[int, int]]:
    """[(start, end)] covering `columns`, each block at most BLOCK_VALUES values of `rows` rows
    (block edges at multiples of `multiple`, so packed columns are never split)."""
    step = max(multiple, (BLOCK_VALUES // max(rows, 1)) // multiple * multiple)
    return [(s, min(s + step, columns)) for s in range(0, columns, step)]


def checkpoint_module_names(prefix: str) -> list[str]:
    """The checkpoint module names a fw layer stands for: itself, or for a fused layer
    (`...qkv_proj`) the projections it fuses (`...q_proj`, `...k_proj`, `...v_proj`)."""
    names = [prefix]
    dotted = prefix + "."
    for sub, (fused_sub, _) in FUSED_PROJECTIONS.items():
        if fused_sub in dotted:
            names.append(dotted.replace(fused_sub, sub)[:-1])
    return names


def skipped_in_checkpoint(prefix: str, listed: Callable[[str], bool]) -> bool:
    """Whether a checkpoint's list of unquantized modules (`listed(module name)`) covers fw layer
    `prefix`, judged on the checkpoint names it stands for: a fused layer (`...qkv_proj`) is left
    unquantized when every projection it fuses is listed. Some listed and some not cannot be one fw
    layer (part of its weight would be float, part quantized): a ModelLoadError that says so."""
    names = checkpoint_module_names(prefix)
    fused = names[1:]
    if listed(prefix) or (fused and all(listed(n) for n in fused)):
        return True
    kept = [n.rsplit(".", 1)[-1] for n in fused if listed(n)]
    if kept:
        quantized = [n.rsplit(".", 1)[-1] for n in fused if not listed(n)]
        raise ModelLoadError(
            f"{prefix}: the checkpoint leaves {', '.join(kept)} unquantized but quantizes {', '.join(quantized)}; "
            f"fw runs them as one fused layer, so they must be quantized alike (list all of them among the "
            f"unquantized modules, or none)")
    return False


def is_lm_head(name: str) -> bool:
    return name == "lm_head" or name.endswith(".lm_head")


def left_unquantized(prefix: str, quant_config: dict, lm_head_quantized: bool = False) -> bool:
    """Whether the checkpoint keeps layer `prefix` in float: the LM head unless the config says it is
    quantized (GPTQModel's `lm_head`), and modules listed in `modules_to_not_convert`."""
    skip = [s for s in quant_config.get("modules_to_not_convert") or [] if s]
    return skipped_in_checkpoint(prefix, lambda name: (not lm_head_quantized and is_lm_head(name))
                                 or any(s in name for s in skip))  # transformers' rule: a substring


# Up to this many rows (decode steps), a matmul over contiguous groups runs group by group on the integer
# codes (`grouped_matmul`) instead of forming the dequantized weight: fewer passes over the weight.
GROUPED_MAX_ROWS = 16


def grouped_matmul(x: torch.Tensor, q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                   group_size: int | None = None) -> torch.Tensor:
    """x [T, in] @ W^T for W^T[i, o] = scales[g, o] * (q[i, o] - zeros[g, o]), g = i // group_size
    (default in / G), in float32. A last group shorter than `group_size` is padded with zero inputs.

    Uses sum_i x[i] * s * (q[i] - z) = s * (sum_i x[i] q[i] - z * sum_i x[i]) per group: the weight
    is read once as float codes (no subtract, multiply and cast passes over it), the rest is [G, T, out]."""
    groups, columns = scales.shape
    size = group_size or x.shape[1] // groups
    x, q = x.float(), q.float()
    if groups * size != x.shape[1]:
        x = torch.nn.functional.pad(x, (0, groups * size - x.shape[1]))
        q = torch.nn.functional.pad(q, (0, 0, 0, groups * size - q.shape[0]))
    xg = x.reshape(x.shape[0], groups, size).transpose(0, 1)  # [G, T, group size]
    partial = torch.bmm(xg, q.view(groups, size, columns))  # [G, T, out]
    partial.sub_(xg.sum(-1, keepdim=True) * zeros[:, None]).mul_(scales[:, None])
    return partial.sum(0)


def repack_for_kernels(layer, q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                       drop: tuple[str, ...]) -> bool:
    """Moves a 4-bit layer (W^T[i, o] = scales[g, o] * (q[i, o] - zeros[g, o]), g = i // group_size) onto fw's
    packed-int kernels where they run on the layer's device and every group holds whole 32-input blocks:
    `layer.packed_int` is set, `layer.qweight` holds its bytes and the other checkpoint tensors named in
    `drop` are deleted.
    False: the layer keeps its reference path. The offsets -scale * zero are rounded to fp16 (a 2^-12
    relative change of each zero point)."""
    inputs = q.shape[0]
    if group_size % packed_int.BLOCK or not packed_int.applies(layer.device, inputs):
        return False
    group = torch.arange(0, inputs, packed_int.BLOCK) // group_size  # each block's group
    s, z = scales.float()[group].T, zeros.float()[group].T  # [out, blocks]
    blocks = packed_int.QuantBlocks(4, q.T.to(torch.uint8), s, -s * z)
    weight = packed_int.pack(blocks)
    for name in drop:
        delattr(layer, name)
    layer.qweight = torch.nn.Parameter(weight.data, requires_grad=False)  # the loader counts it as loaded
    layer.packed_int = [weight]
    return True


W4A16_MAX_ROWS = 256  # rows up to which CUDA 4-bit layers run gptq_triton (measured 3.9x the dequantize-then-
# GEMM path at 256 rows on an H200; larger inputs, not measured, keep that path)


def runs_w4a16_triton(x: torch.Tensor, rows: int) -> bool:
    """Whether a 4-bit product with contiguous groups runs gptq_triton's W4A16 kernel: CUDA inputs of up to
    W4A16_MAX_ROWS rows where triton is installed. The gptq and awq methods both decide here."""
    return x.is_cuda and rows <= W4A16_MAX_ROWS and importlib.util.find_spec("triton") is not None
