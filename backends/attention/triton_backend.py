"""The `triton` attention backend: Triton kernels over the paged KV cache, for CUDA.

Each step writes the new K/V into their slots (torch: one index_copy_ per cache, after converting
to the cache dtype exactly as `sdpa` does, so both backends hold the same cache bytes), then runs
at most two kernels per layer, reading K/V straight from the pages through the block table:

* decodes (the first `num_decodes` sequences, one query each): split-K / flash-decoding. Each
  (sequence, KV head, context partition) program scores all query heads of its GQA group against
  its partition with an online softmax and writes the partial output and its log-sum-exp; a reduce
  kernel combines the partitions. Short contexts at large batch use one partition and no reduce.
* prefill chunks (the rest): each (sequence, query head, block of 32-64 rows) program attends its rows to
  the cached prefix plus the chunk itself, causal, visiting only the key blocks the rows can see.

Sliding windows and soft-capping follow transformers (as the `sdpa` docstring states); an fp8
cache is dequantized in the kernel with the layer's k_scale / v_scale. The kernels live in
`triton_kernels`, imported on first use so that listing plugins never imports triton.

The spec declares CUDA only. With TRITON_INTERPRET=1 set before triton is first imported, the
same kernels run on CPU tensors; the tests call this class directly that way."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

from fw.errors import UnsupportedConfigurationError
from fw.layers.attention import AttentionBackend, AttentionMetadata
from fw.plugins import AttentionBackendSpec, Verified, hookimpl

FW_PLUGIN_API_VERSION = "1.2"  # dtype_min_capability, kv_cache_dtype_min_capability, verified_on

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
MAX_HEAD_DIM = 256  # one [rows, head dim] tile per program: larger heads exhaust registers/shared memory


def unavailable() -> str | None:
    """Why the backend cannot serve in this process, or None."""
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed (pip install triton)"
    if not torch.cuda.is_available():
        return "no CUDA device (triton kernels need a GPU; use sdpa or cpu_paged on CPU)"
    return None


def kernels():
    """The kernel module (imports triton on first call)."""
    # here: the kernels import triton: only on first use (plugin listing loads this module)
    from fw.backends.attention import triton_kernels

    return triton_kernels


@dataclass
class _Step:
    """Host-side sizes of one step, computed once for all layers (no device sync)."""

    num_decodes: int
    max_decode_len: int
    num_prefills: int
    max_query_len: int  # over the prefill chunks


def quantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x in the cache dtype: fp8 values are x / scale saturated to the format's finite range (a plain
    cast would give NaN or inf); other dtypes are a cast. The same bytes `sdpa` writes."""
    if dtype not in _FP8:
        return x.to(dtype)
    limit = torch.finfo(dtype).max
    scaled = x.float() if scale == 1.0 else x.float() / scale
    return scaled.clamp_(-limit, limit).to(dtype)


def store_kv(cache: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, scale: float = 1.0) -> None:
    """New K or V [T, Hkv, D] into their slots of one cache [pages, page_size, Hkv, D] (contiguous)."""
    rows = x.reshape(x.shape[0], -1)
    if cache.dtype != x.dtype:
        rows = quantize_kv(rows, cache.dtype, scale)
    flat = cache.view(-1, rows.shape[1])
    if cache.dtype in _FP8:  # index_copy_ has no fp8 kernel: move the bytes
        flat, rows = flat.view(torch.uint8), rows.view(torch.uint8)
    flat.index_copy_(0, slots, rows)


class TritonBackend(AttentionBackend):
    # Per-layer K/V scales of an fp8 cache; the loader sets them from the checkpoint (default 1.0).
    k_scale: float = 1.0
    v_scale: float = 1.0
    # Kernel tiling (tests shrink them to cover many blocks and partitions on small shapes).
    block_m: int | None = None  # prefill query rows per program; None: 64, or 32 for wide heads
    block_n: int | None = None  # keys per loop iteration; None: as block_m
    num_splits: int | None = None  # decode partitions per sequence; None: enough to fill the device

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedConfigurationError(
                f"the triton attention backend needs query heads in equal groups per KV head; this model has "
                f"{self.num_heads} query heads for {self.num_kv_heads} KV heads. Use --attention-backend sdpa.")

    @staticmethod
    def kv_cache_shape(num_blocks: int, page_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """[2 (K, V), pages, page_size, kv heads, head dim]: a new token's K (all heads) is one row, so the
        store is one index_copy_; the kernels read a head's page as page_size rows of head_dim."""
        return (2, num_blocks, page_size, num_kv_heads, head_dim)

    @classmethod
    def prepare(cls, meta: AttentionMetadata) -> _Step:
        d = meta.num_decodes
        return _Step(
            num_decodes=d,
            max_decode_len=max(meta.seq_lens[:d], default=0),
            num_prefills=meta.num_seqs - d,
            max_query_len=max(meta.query_lens[d:], default=0),
        )

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        k_cache, v_cache = kv_cache[0], kv_cache[1]  # [pages, page_size, Hkv, D]
        store_kv(k_cache, k, meta.slot_mapping, self.k_scale)
        store_kv(v_cache, v, meta.slot_mapping, self.v_scale)
        step: _Step = meta.backend_state if meta.backend_state is not None else self.prepare(meta)
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty_like(q)
        ops = kernels()
        options = dict(sliding_window=self.sliding_window, logit_softcap=self.logit_softcap,
                       k_scale=self.k_scale, v_scale=self.v_scale, block_n=self.block_n)
        d = step.num_decodes
        if d:
            ops.decode_attention(q[:d], k_cache, v_cache, meta.block_tables[:d], meta.seq_lens_tensor[:d],
                                 step.max_decode_len, self.scale, out[:d], num_splits=self.num_splits, **options)
        if step.num_prefills:
            ops.prefill_attention(q, k_cache, v_cache, meta.block_tables[d:], meta.seq_lens_tensor[d:],
                                  meta.query_start_loc[d:], step.max_query_len, self.scale, out,
                                  block_m=self.block_m, **options)
        return out


@hookimpl
def fw_register_attention_backends(register) -> None:
    register(AttentionBackendSpec(
        name="triton",
        backend_cls=TritonBackend,
        devices=("cuda",),
        dtypes=("float32", "bfloat16", "float16"),
        head_sizes=tuple(range(8, MAX_HEAD_DIM + 1, 8)),
        supports_sliding_window=True,
        supports_logit_softcap=True,
        kv_cache_dtypes=("auto", "bfloat16", "fp8_e4m3", "fp8_e5m2"),
        priority=20,
        available=unavailable,
        # Triton compiles bf16 `tl.dot` from sm_80 and e4m3 conversions from sm_89 (Ada, Hopper): not for sm_80.
        dtype_min_capability={"bfloat16": (8, 0)},
        kv_cache_dtype_min_capability={"bfloat16": (8, 0), "fp8_e4m3": (8, 9)},
        # tests/test_triton_attention.py -m gpu (bf16/fp16/fp32, fp8 caches, greedy = sdpa) on an H200
        verified_on=(Verified("cuda", (9, 0), "NVIDIA H200", "2026-11-25", "scripts/gpu_acceptance.sh"),),
        description="Triton paged attention: split-K decode and ragged paged prefill (GQA, sliding windows, "
                    "soft-capping, bf16/fp8 KV cache)",
    ))
