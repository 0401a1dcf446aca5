"""The `flex` attention backend: torch's FlexAttention (`torch.nn.attention.flex_attention`) reading K/V
straight from the paged cache, on CPU and CUDA.

How paging becomes a block mask (the way PyTorch's paged-attention example does it): a layer's cache
[2, Hkv, pages, page_size, D] is viewed as one long key sequence of `pages * page_size` physical
slots, and all query tokens of the step as one query sequence. The block mask's KV block is one page,
so each query block (`Q_BLOCK` rows) lists exactly the physical pages its sequences use (the union over
the sequences with rows in that block, read from the block table); FlexAttention visits only those.
Inside a visited page, `mask_mod` decides per (row, slot) from a slot table: the logical position that
slot holds for the row's sequence (-1 when the slot is not that sequence's), causal against the row's
position, and the sliding window. The slot table has one row per sequence, so a page shared by
prefix caching maps correctly for each sequence. Soft-capping is a `score_mod`:
cap * tanh(s / cap) on the scaled score, as in `sdpa` (whose docstring defines window and cap).

Compilation: FlexAttention without torch.compile runs an unfused reference that materialises scores
over every slot of the cache, so the backend always calls `torch.compile(flex_attention,
dynamic=True)`, compiled once per configuration (dtype, head layout, page size, cache size,
soft-cap) and process, and reused (dynamo guards on the mask's code, not on the per-step tensors it
captures): not per batch. Three details work around torch 2.13's CPU (inductor C++) template, which
otherwise generated C++ that did not compile:

- duck sizing is off during the call: with it, which sizes of a step happened to be equal (the
  sequence count and the head count, say) changed the generated code;
- the cache length (and the slot table's width) is marked static: it is fixed for an engine;
- the slot table is indexed by (sequence, slot), with no `slot // page_size` in `mask_mod`.

The query is also padded to at least two blocks: dynamo specialises sizes 0 and 1 and would compile
again for a lone decode. Measured on this machine's 2 cores (cold inductor cache): the first compile
18-27 s, each further family 4-16 s, 1-2 s from a warm cache in a later process. On CPU it is slower
than `sdpa` and `cpu_paged` (docs/attention-backends.md), hence its low CPU priority."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from fw.errors import UnsupportedConfigurationError
from fw.layers.attention import AttentionBackend, AttentionMetadata
from fw.plugins import AttentionBackendSpec, Verified, hookimpl

FW_PLUGIN_API_VERSION = "1.2"  # priority_by_device, dtype_min_capability, verified_on

Q_BLOCK = 16  # query rows per block-mask block (the triton kernel's smallest tile on CUDA)
_NO_WINDOW = 1 << 30  # a window wider than any context: one mask_mod for layers with and without one

_compiled: dict[tuple, Callable[..., torch.Tensor]] = {}


def compiled_flex_attention(key: tuple) -> Callable[..., torch.Tensor]:
    """flex_attention under torch.compile, one wrapper per configuration `key` (device, dtypes, head
    layout, page and cache size, soft-cap or not), reused by every later call with that key.

    One wrapper per key, each with its recompile budget of its own (`isolate_recompiles`): with a
    single shared one, a process running several configurations (a test suite, two engines) used up
    dynamo's recompile limit of 8 and fell back to the unfused path without saying so."""
    if key not in _compiled:
        # here: FlexAttention's modules cost start-up time; only this backend's use needs them
        import torch.fx.experimental._config as fx_config
        from torch.nn.attention.flex_attention import flex_attention  # here: as above

        from fw.compile.isolated import compile_isolated  # here: importing fw.compile is not free at plugin listing

        compiled = compile_isolated(flex_attention, dynamic=True)

        def call(*args: Any, **kwargs: Any) -> torch.Tensor:
            with fx_config.patch(use_duck_shape=False):
                return compiled(*args, **kwargs)

        _compiled[key] = call
    return _compiled[key]


def _unavailable() -> str | None:
    """Why FlexAttention cannot run in this process: torch too old, or (without CUDA) no C++
    compiler for inductor's CPU kernels."""
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError as exc:
        return f"torch {torch.__version__} has no torch.nn.attention.flex_attention ({exc}); needs torch>=2.5"
    if torch.cuda.is_available():
        return None
    compilers = [os.environ.get("CXX"), "c++", "g++", "clang++"]
    if not any(c and shutil.which(c) for c in compilers):
        return "no C++ compiler (c++, g++ or clang++; or $CXX) for torch.compile's CPU kernels"
    return None


@dataclass
class _Step:
    """What every layer of one step shares: each query row's sequence and position, and (built by the
    first layer, once the cache size is known) the slot table and the block masks per window."""

    meta: AttentionMetadata
    num_tokens: int
    padded: int  # rows after padding to whole query blocks (at least two)
    row_seq: torch.Tensor  # [padded] int32, the sequence of each row; padding rows -> num_seqs (all -1)
    row_pos: torch.Tensor  # [padded] int32, absolute position of each row's token
    seq_ranges: list[tuple[int, int, int]]  # per sequence: (first row, rows, position of the first row)
    tables_cpu: torch.Tensor  # block table on the host, for building block masks
    slot_pos: torch.Tensor | None = None  # [num_seqs + 1, slots] int32: logical position or -1
    block_masks: dict[int, Any] = field(default_factory=dict)  # window (0 = none) -> BlockMask


class FlexBackend(AttentionBackend):
    """Stores new K/V in the paged cache, then one FlexAttention call per layer attends every row of
    the step (decodes and prefill chunks alike) over the pages its block-mask row lists."""

    @staticmethod
    def kv_cache_shape(num_blocks: int, page_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """[2 (K, V), kv heads, pages, page_size, head dim]: one head's cache is one contiguous run
        of physical slots, the key sequence FlexAttention reads."""
        return (2, num_kv_heads, num_blocks, page_size, head_dim)

    @classmethod
    def prepare(cls, meta: AttentionMetadata) -> _Step:
        dev = meta.block_tables.device
        p = meta.page_size
        if dev.type == "cuda" and (p < 16 or p & (p - 1)):
            raise UnsupportedConfigurationError(
                f"the flex backend on CUDA needs KV pages of a power of two of at least 16 tokens (a page is "
                f"a kernel tile); got --kv-cache-page-size {p}. Pass --kv-cache-page-size 16 or another backend.")
        t = sum(meta.query_lens)  # from the host: no device sync
        padded = max(2, -(-t // Q_BLOCK)) * Q_BLOCK
        row_seq = torch.full((padded,), meta.num_seqs, dtype=torch.int32)
        row_pos = torch.zeros(padded, dtype=torch.int32)
        ranges, start = [], 0
        for i, (n, length) in enumerate(zip(meta.query_lens, meta.seq_lens)):
            row_seq[start:start + n] = i
            row_pos[start:start + n] = torch.arange(length - n, length, dtype=torch.int32)
            ranges.append((start, n, length - n))
            start += n
        return _Step(meta, t, padded, row_seq.to(dev), row_pos.to(dev), ranges, meta.block_tables.cpu())

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        k_cache, v_cache = kv_cache[0], kv_cache[1]  # [Hkv, pages, page_size, D]
        self._store(k_cache, k, meta.slot_mapping)
        self._store(v_cache, v, meta.slot_mapping)
        step: _Step = meta.backend_state
        hkv, pages, page, d = k_cache.shape
        slots = pages * page
        if step.slot_pos is None or step.slot_pos.shape[1] != slots:
            step.slot_pos, step.block_masks = _slot_positions(step, slots), {}
        block_mask = self._block_mask(step, pages, page)
        query = q.new_zeros(step.padded, self.num_heads, d)
        query[: step.num_tokens] = q
        keys, values = k_cache.view(1, hkv, slots, d), v_cache.view(1, hkv, slots, d)
        for t, dim in ((keys, 2), (values, 2), (step.slot_pos, 1)):
            torch._dynamo.mark_static(t, dim)
        key = (q.device.type, q.dtype, k_cache.dtype, self.num_heads, hkv, d, page, slots,
               self.logit_softcap is not None)
        out = compiled_flex_attention(key)(
            query.transpose(0, 1).unsqueeze(0), keys, values,
            score_mod=_softcap_mod(self.logit_softcap, q.device) if self.logit_softcap else None,
            block_mask=block_mask, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads,
            kernel_options=_kernel_options(q.device, page),
        )
        return out[0, :, : step.num_tokens].transpose(0, 1)

    def _block_mask(self, step: _Step, pages: int, page: int):
        window = self.sliding_window or 0
        if window not in step.block_masks:
            step.block_masks[window] = _build_block_mask(step, pages, page, window)
        return step.block_masks[window]

    def _store(self, cache: torch.Tensor, x: torch.Tensor, slots: torch.Tensor) -> None:
        """New K or V [T, Hkv, D] into their slots of one layer's cache [Hkv, pages, page_size, D]."""
        cache.view(self.num_kv_heads, -1, self.head_dim).index_copy_(1, slots, x.transpose(0, 1).to(cache.dtype))


def _slot_positions(step: _Step, slots: int) -> torch.Tensor:
    """[num_seqs + 1, slots]: for each sequence, the logical position each physical slot holds for it,
    -1 for slots that are not its (and the whole last row, the padding rows' sequence)."""
    meta = step.meta
    dev = meta.block_tables.device
    table = torch.full((meta.num_seqs + 1, slots), -1, dtype=torch.int32, device=dev)
    if meta.num_seqs == 0:
        return table
    longest = max(meta.seq_lens)
    pos = torch.arange(longest, device=dev)
    blocks = meta.block_tables[:, : -(-longest // meta.page_size)]
    slot = blocks.repeat_interleave(meta.page_size, dim=1)[:, :longest] * meta.page_size + pos % meta.page_size
    valid = pos.unsqueeze(0) < meta.seq_lens_tensor.unsqueeze(1)
    rows = torch.arange(meta.num_seqs, device=dev).unsqueeze(1).expand_as(slot)
    table[rows[valid], slot[valid]] = pos.expand_as(slot)[valid].to(torch.int32)
    return table


def _build_block_mask(step: _Step, pages: int, page: int, window: int):
    """The step's block mask: per query block, the physical pages any of its rows may see, and the
    exact per-slot rule as `mask_mod`."""
    from torch.nn.attention.flex_attention import BlockMask  # here: FlexAttention's modules cost start-up time

    num_q_blocks = step.padded // Q_BLOCK
    used = torch.zeros(num_q_blocks, pages, dtype=torch.bool)
    for i, (first, rows, pos0) in enumerate(step.seq_ranges):
        for qb in range(first // Q_BLOCK, (first + rows - 1) // Q_BLOCK + 1):
            lo_row, hi_row = max(first, qb * Q_BLOCK), min(first + rows, (qb + 1) * Q_BLOCK) - 1
            lo_pos, hi_pos = pos0 + lo_row - first, pos0 + hi_row - first
            first_key = max(0, lo_pos - window + 1) if window else 0
            used[qb, step.tables_cpu[i, first_key // page: hi_pos // page + 1]] = True
    counts = used.sum(dim=-1, dtype=torch.int32)
    order = used.to(torch.int8).argsort(dim=-1, descending=True, stable=True).to(torch.int32)
    dev = step.row_seq.device
    return BlockMask.from_kv_blocks(
        counts[None, None].to(dev), order[None, None].to(dev), BLOCK_SIZE=(Q_BLOCK, page),
        mask_mod=_paged_mask_mod(step.slot_pos, step.row_seq, step.row_pos, window or _NO_WINDOW),
        seq_lengths=(step.padded, pages * page),
    )


def _paged_mask_mod(slot_pos: torch.Tensor, row_seq: torch.Tensor, row_pos: torch.Tensor, window: int):
    """Row q may see physical slot kv when that slot holds one of its sequence's positions p with
    q_pos - window < p <= q_pos. `window` is a tensor so every window size shares one compile."""
    width = torch.tensor(window, dtype=torch.int32, device=row_pos.device)

    def mask_mod(b, h, q_idx, kv_idx):
        key_pos = slot_pos[row_seq[q_idx], kv_idx]
        query_pos = row_pos[q_idx]
        return (key_pos >= 0) & (key_pos <= query_pos) & (key_pos > query_pos - width)

    return mask_mod


def _softcap_mod(cap: float, device: torch.device):
    """Gemma 2's attention-logit soft-capping on the scaled score: cap * tanh(s / cap)."""
    cap_t = torch.tensor(cap, dtype=torch.float32, device=device)

    def score_mod(score, b, h, q_idx, kv_idx):
        return cap_t * torch.tanh(score / cap_t)

    return score_mod


def _kernel_options(device: torch.device, page: int) -> dict[str, int] | None:
    """On CUDA the kernel's tiles must divide the block mask's blocks (Q_BLOCK rows, one page of keys)."""
    if device.type != "cuda":
        return None
    return {"BLOCK_M": Q_BLOCK, "BLOCK_N": min(page, 64)}


@hookimpl
def fw_register_attention_backends(register) -> None:
    register(AttentionBackendSpec(
        name="flex",
        backend_cls=FlexBackend,
        devices=("cpu", "cuda"),
        dtypes=("float32", "bfloat16", "float16"),
        supports_sliding_window=True,
        supports_logit_softcap=True,
        # CPU: below sdpa (0) and cpu_paged (10), slower there by measurement (docs/attention-backends.md);
        # CUDA: a fused kernel, above sdpa, below triton (20) and flash-attn (40).
        priority=-10,
        priority_by_device={"cuda": 10},
        available=_unavailable,
        dtype_min_capability={"bfloat16": (8, 0)},  # its CUDA kernel is Triton's: bf16 dots from sm_80
        verified_on=(Verified("cpu", by="fw's CPU tests"),
                     Verified("cuda", (9, 0), "NVIDIA H200", "2026-11-25", "scripts/gpu_acceptance.sh")),
        description="torch FlexAttention (torch.compile) over the paged KV cache through a block mask built "
                    "from the block table; sliding windows, soft-capping (compiles at first use)",
    ))
