"""Tensor-parallel linear layers: the weight split across the ranks of a `TensorParallel` group.

Megatron's pairing: a column-parallel projection gives each rank a slice of the output features
(its attention heads of a fused q/k/v, its columns of a fused gate/up), every rank then works on
its slice alone, and a row-parallel projection (o_proj, down_proj) multiplies that slice by the
matching rows of the input dimension and sums the partial products over the ranks with one
all-reduce. One all-reduce per block, none between the two halves.

Each rank keeps only its slice: the checkpoint tensor (memory-mapped by the safetensors reader)
is narrowed before the copy. A row-parallel bias is added by rank 0's partial sum alone. At one
rank both classes are plain `Linear`s. Dense weights split, and so do GGUF weights kept packed
(`GGUFWeight`: rows are independent, and blocks run along the input dimension, so a row-parallel
rank's columns are cut between blocks or refused). Other quantization methods pack rows and groups
their own way, so they are refused by name rather than cut at a wrong boundary."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from fw.distributed.group import tensor_parallel_of
from fw.errors import UnsupportedConfigurationError
from fw.layers.gguf_weight import GGUFWeight
from fw.kernels.step_program import NotReplayable, replays
from fw.layers.linear import Linear, UnquantizedLinearMethod


def _check_dense(layer: Linear) -> None:
    splits = type(layer.method) is UnquantizedLinearMethod or getattr(layer.method, "keeps_gguf_blocks", False)
    if layer.tp.size > 1 and not splits:
        raise UnsupportedConfigurationError(
            f"--tensor-parallel-size {layer.tp.size}: {layer.prefix} uses the {type(layer.method).__name__} "
            f"quantization method, whose packed weights fw does not split across ranks yet; serve a dense "
            f"(bf16/fp32) checkpoint, or use --tensor-parallel-size 1")


def _rows(tensor: torch.Tensor | GGUFWeight, start: int, length: int) -> torch.Tensor | GGUFWeight:
    return tensor.narrow_rows(start, length) if isinstance(tensor, GGUFWeight) else tensor.narrow(0, start, length)


def split_evenly(total: int, ranks: int, what: str, prefix: str) -> int:
    """`total / ranks`, or the refusal that names --tensor-parallel-size, the layer and what does not divide."""
    if total % ranks:
        raise UnsupportedConfigurationError(
            f"--tensor-parallel-size {ranks}: {prefix} has {total} {what}, which do not divide by {ranks}; "
            f"choose a tensor-parallel size that divides {total}")
    return total // ranks


def deal(units: int, ranks: int, rank: int) -> tuple[int, int]:
    """(first unit, count) of `rank` when `units` (say, KV-head groups) are dealt out as evenly as they go,
    the extra ones to the lowest ranks: rank 0 holds the most, so the KV pages it can afford (and decides
    for every rank) fit every other rank's budget too."""
    base, extra = divmod(units, ranks)
    return rank * base + min(rank, extra), base + (rank < extra)


def split_heads(num_heads: int, num_kv_heads: int, tp: int, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """((first query head, count), (first KV head, count)) of `rank` among `tp`, in heads, or the refusal that
    names both counts. Three layouts, tried in turn: an even split by heads; KV groups (a KV head and the query
    heads that read it) dealt out unevenly when there are at least as many KV heads as ranks; and, with fewer KV
    heads than ranks (vLLM's layout), each KV head replicated on the tp / num_kv_heads ranks that share it, which
    deal out its group's query heads among themselves (evenly when they divide, else the extra to the lowest)."""
    if num_heads % tp == 0 and num_kv_heads % tp == 0:
        q, kv = num_heads // tp, num_kv_heads // tp
        return (rank * q, q), (rank * kv, kv)
    per = num_heads // num_kv_heads if num_heads % num_kv_heads == 0 else 0  # query heads per KV head
    if per and num_kv_heads >= tp:
        first, groups = deal(num_kv_heads, tp, rank)
        return (first * per, groups * per), (first, groups)
    if per and tp % num_kv_heads == 0 and tp <= num_heads:
        sharing = tp // num_kv_heads  # ranks that hold the same KV head
        kv_head = rank // sharing
        first, count = deal(per, sharing, rank % sharing)
        return (kv_head * per + first, count), (kv_head, 1)
    raise UnsupportedConfigurationError(
        f"--tensor-parallel-size {tp}: the model has {num_heads} attention heads and {num_kv_heads} KV heads; fw "
        f"splits attention by heads, unevenly by KV group (a KV head and its query heads) when every rank gets one, "
        f"or with each KV head replicated on the ranks that share it when the size is a multiple of the KV heads "
        f"and every rank gets a query head; choose a size of at most {num_kv_heads}, or a multiple of "
        f"{num_kv_heads} up to {num_heads}")


class ColumnParallelLinear(Linear):
    """Each rank holds rows [rank*n, (rank+1)*n) of every fused output shard (so a fused q/k/v
    keeps q, k and v contiguous on each rank), or the rows `slices` gives per shard ((start,
    length), for uneven splits: attention by KV group). `output_sizes` are the whole model's; the
    layer's own `output_sizes` are its rank's."""

    def __init__(self, input_size: int, output_sizes: int | list[int], ctx, prefix: str, bias: bool = False,
                 slices: list[tuple[int, int]] | None = None):
        tp = tensor_parallel_of(ctx)
        sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        if slices is None:
            local = [split_evenly(s, tp.size, "output features", prefix) for s in sizes]
            slices = [(tp.rank * n, n) for n in local]
        super().__init__(input_size, [length for _, length in slices], ctx, prefix, bias)
        self.tp, self.slices, self.whole_sizes = tp, slices, sizes
        _check_dense(self)

    def load_weight(self, param_name: str, tensor: torch.Tensor, shard: int | None = None) -> None:
        if self.tp.size > 1 and shard is None and len(self.slices) > 1:  # already fused: each shard its own rows
            offsets = [sum(self.whole_sizes[:i]) for i in range(len(self.whole_sizes))]
            for i, (offset, size) in enumerate(zip(offsets, self.whole_sizes)):
                self.load_weight(param_name, _rows(tensor, offset, size), i)
            return
        if self.tp.size > 1:
            size = self.output_size if shard is None else self.output_sizes[shard]
            start = self.slices[0][0] if shard is None else self.slices[shard][0]
            tensor = _rows(tensor, start, size)
        super().load_weight(param_name, tensor, shard)


@dataclass(frozen=True)
class WholeRows:
    """What a row-parallel rank knows of its input rows beyond its slice: how many features a whole row has, and
    how to sum a per-row statistic over the ranks. For kernels whose numerics read the whole row (fw's packed-int
    kernels choose each row's heavy blocks against the row's mean), so a rank decides as one process would."""

    features: int
    sum: Callable[[torch.Tensor], torch.Tensor]


class RowParallelLinear(Linear):
    """Each rank holds input columns [rank*n, (rank+1)*n), or `input_slice` (start, length), and the
    output is summed over the ranks. `input_size` is the whole model's. `reduce_results=False` leaves
    the partial sum for the caller to reduce together with others (a MoE block's shared expert and its
    experts: one all-reduce for both, as vLLM does)."""

    def __init__(self, input_size: int, output_size: int, ctx, prefix: str, bias: bool = False,
                 input_slice: tuple[int, int] | None = None, reduce_results: bool = True):
        tp = tensor_parallel_of(ctx)
        if input_slice is None:
            n = split_evenly(input_size, tp.size, "input features", prefix)
            input_slice = (tp.rank * n, n)
        super().__init__(input_slice[1], output_size, ctx, prefix, bias)
        self.tp, self.input_start, self.reduce_results = tp, input_slice[0], reduce_results
        self.whole_rows = WholeRows(input_size, tp.all_reduce) if tp.size > 1 else None
        _check_dense(self)

    def load_weight(self, param_name: str, tensor: torch.Tensor, shard: int | None = None) -> None:
        if self.tp.size > 1:
            if param_name == "bias":  # summed over ranks: only rank 0 adds it
                tensor = tensor if self.tp.rank == 0 else torch.zeros_like(tensor)
            elif isinstance(tensor, GGUFWeight):  # packed: cut between blocks
                tensor = tensor.narrow_cols(self.input_start, self.input_size,
                                            f"--tensor-parallel-size {self.tp.size}: {self.prefix}")
            else:
                tensor = tensor.narrow(1, self.input_start, self.input_size)
        super().load_weight(param_name, tensor, shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = self.method.apply(self, x)
        return self.tp.all_reduce(partial) if self.reduce_results else partial

    def emit_step(self, b, x):
        """`forward` as a step program's calls (fw.layers.replay), on one rank only: the program makes no
        collective calls."""
        replays(self, RowParallelLinear)
        if self.tp.size > 1:
            raise NotReplayable(f"tensor parallelism ({self.tp.size} ranks)")
        return self.method.emit_step(self, b, x)
