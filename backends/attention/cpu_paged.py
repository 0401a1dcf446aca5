"""The `cpu_paged` attention backend: one C++ kernel for CPU attention over the paged cache.

Batched decode in `sdpa` gathers every sequence's pages into a padded
[Hkv, B, L, D] copy and runs two bmm's over it; at batch 64 that copy and the
padding cost more than the attention itself, and its prefill runs one SDPA
call per sequence per layer, far below the CPU's matmul rate (docs/performance.md).
This kernel reads K and V straight from the paged cache through the block
table: per (query row, KV head) it scores the group's query heads against the
keys the row may see, softmaxes in fp32 and accumulates the values in fp32.
A prompt row is a decode whose sequence ends at its own position, so decode
and prefill (with or without a cached prefix) are one call per layer; the
row's keys stay in cache across the rows of a sequence.

The kernel is built by `pip install` (setup.py, -O3 -march=native, OpenMP
through ATen's parallel_for) and loaded through fw.kernels.loader; where that build
is missing or stale, it is compiled at first use with torch's cpp_extension
and cached under the fw cache dir, keyed by the source, the torch version and
the CPU's flags."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fw import kernels
from fw.errors import FwError
from fw.kernels.loader import load_cpp_ops, unavailable
from fw.layers.attention import AttentionBackend, AttentionMetadata
from fw.plugins import AttentionBackendSpec, Verified, hookimpl

FW_PLUGIN_API_VERSION = "1.2"  # verified_on

_SOURCE = kernels.source("cpu_paged.cpp")  # with fw's other C++ sources (fw.kernels)


def _unavailable() -> str | None:
    why = unavailable("cpu_paged", _SOURCE)
    return f"{why}: needed to build the cpu_paged kernel (fw was installed without it)" if why else None


def load_kernel() -> None:
    """Load the kernel (installed, cached, or built now) once per process; registers torch.ops.fw_cpu_paged."""
    try:
        load_cpp_ops("cpu_paged", _SOURCE)
    except FwError as exc:
        raise FwError(f"{exc}\nPass --attention-backend sdpa to run without it.") from exc


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, out: torch.Tensor, window: int | None = None,
                 softcap: float | None = None) -> None:
    """out[b, h] = softmax(scale * q[b, h] . K_b^T) V_b, K_b/V_b the first seq_lens[b] positions of the
    pages block_tables[b] lists, read from k_cache/v_cache [Hkv, pages, page_size, D] of KV head
    h // (H // Hkv). q and out: [B, H, D]. With `window`, only the last `window` positions count (a query
    at p sees (p - window, p], as transformers); with `softcap`, scores become softcap * tanh(s / softcap)
    after scaling, before the softmax."""
    load_kernel()
    torch.ops.fw_cpu_paged.decode(q, k_cache, v_cache, block_tables, seq_lens, scale, window or 0, softcap or 0.0,
                                  out)


@dataclass
class _Rows:
    """Every query row of a step as its own decode: the block-table row of its sequence and the number
    of keys it sees (causal: a prompt row at position p sees p + 1 keys)."""

    tables: torch.Tensor  # [T, max_blocks]
    lens: torch.Tensor  # [T]


class CpuPagedBackend(AttentionBackend):
    """Writes the new K/V into the paged cache, then one C++ kernel call attends every query row (decode
    and prefill alike) over its sequence's pages."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        load_kernel()  # at model build, not in the first step; a failed build is reported up front

    @staticmethod
    def kv_cache_shape(num_blocks: int, page_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """[2 (K, V), kv heads, pages, page_size, head dim]: a sequence's keys of one head are whole pages."""
        return (2, num_kv_heads, num_blocks, page_size, head_dim)

    @classmethod
    def prepare(cls, meta: AttentionMetadata) -> _Rows:
        if meta.num_decodes == meta.num_seqs:  # decode-only step: one row per sequence already
            return _Rows(meta.block_tables, meta.seq_lens_tensor)
        dev = meta.block_tables.device
        query_lens = torch.tensor(meta.query_lens, device=dev)
        seq_of_row = torch.repeat_interleave(torch.arange(meta.num_seqs, device=dev), query_lens)
        offset = torch.arange(seq_of_row.numel(), device=dev) - meta.query_start_loc[:-1].index_select(0, seq_of_row)
        lens = (meta.seq_lens_tensor - query_lens).index_select(0, seq_of_row) + offset + 1
        return _Rows(meta.block_tables.index_select(0, seq_of_row), lens)

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        k_cache, v_cache = kv_cache[0], kv_cache[1]  # [Hkv, pages, page_size, D]
        torch.ops.fw_cpu_paged.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        rows: _Rows = meta.backend_state
        out = torch.empty_like(q)
        paged_decode(q, k_cache, v_cache, rows.tables, rows.lens, self.scale, out, self.sliding_window,
                     self.logit_softcap)
        return out

    step_input_names = ("slots", "tables", "lens")

    @classmethod
    def step_inputs(cls, meta: AttentionMetadata) -> tuple[torch.Tensor, ...]:
        rows: _Rows = meta.backend_state
        return meta.slot_mapping, rows.tables, rows.lens

    def emit_step(self, b, q, k, v, kv_cache: torch.Tensor):
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        b.call("fw_cpu_paged::store_kv", k, v, k_cache, v_cache, b.input("slots"))
        out = b.empty(q)
        b.call("fw_cpu_paged::decode", q, k_cache, v_cache, b.input("tables"), b.input("lens"), self.scale,
               self.sliding_window or 0, self.logit_softcap or 0.0, out)
        return out


@hookimpl
def fw_register_attention_backends(register) -> None:
    register(AttentionBackendSpec(
        name="cpu_paged",
        backend_cls=CpuPagedBackend,
        devices=("cpu",),
        dtypes=("float32", "bfloat16", "float16"),
        priority=10,
        supports_sliding_window=True,
        supports_logit_softcap=True,
        available=_unavailable,
        verified_on=(Verified("cpu", by="fw's CPU tests"),),
        description="C++ CPU attention (decode and prefill) reading K/V straight from the paged cache "
                    "(built by pip install; else at first use, which needs a C++ compiler and ninja)",
    ))


@hookimpl
def fw_warm_cache_artifacts(context, add) -> None:
    """`fw warm-cache` builds the kernel ahead when the server with these flags would choose cpu_paged."""
    from fw.warm import CppOpsArtifact  # here: fw warm-cache's hook; serving never loads the warm-cache tooling

    add(CppOpsArtifact("cpu_paged", _SOURCE, owner="cpu_paged", applies=_kernel_needed))


def _kernel_needed(context) -> bool:
    from fw.warm import resolve  # here: fw warm-cache's hook; serving never loads the warm-cache tooling

    chosen = resolve.attention_backend(context)
    if chosen is None:  # the model's files are not there yet (--check before a download): go by the flags
        return resolve.device(context).type == "cpu" and context.config.attention_backend in ("auto", "cpu_paged")
    return chosen == "cpu_paged"
