"""Triton kernels of the `triton` attention backend, and the launchers `fw bench kernels` times.

Importing this module imports triton, so the plugin module imports it lazily (listing plugins and
start-up stay free of triton's import). Set TRITON_INTERPRET=1 before the first `import triton` to
run the kernels on CPU tensors (the tests do, in a subprocess).

Cache layout: each layer's K (or V) cache is [pages, page_size, kv heads, head dim]; any strides
with a unit last stride work. A token at position p of sequence b lives in page
block_tables[b, p // page_size] at offset p % page_size, so page sizes need not be powers of two.
Head dims and GQA group sizes are padded to powers of two (at least 16, for tl.dot) with masks.

Numerics follow the `sdpa` reference: scores scale * q.k in fp32 (IEEE fp32 dots for fp32 inputs,
no TF32), optional soft-capping cap * tanh(s / cap), then masking (causal, and the sliding window
(p - window, p]), an online fp32 softmax, probabilities cast to the value dtype for the second dot.
An fp8 cache is read as fp8, multiplied by its layer's k_scale / v_scale in fp32 and cast to the
query dtype, as sdpa dequantizes it.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@triton.jit
def _tanh(x):
    """tanh from exp of a non-positive argument: no overflow (tl has no portable tanh)."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def _load_kv(cache_ptr, page, off, kv_head, d, valid, d_mask, stride_p, stride_o, stride_h, kv_scale,
             KV_SCALED: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """[BLOCK_N, D_PAD] keys (or values) of one KV head at the given pages/offsets, in OUT_DTYPE."""
    ptrs = cache_ptr + page[:, None] * stride_p + off[:, None] * stride_o + kv_head * stride_h + d[None, :]
    x = tl.load(ptrs, mask=valid[:, None] & d_mask[None, :], other=0.0)
    if KV_SCALED:
        return (x.to(tl.float32) * kv_scale).to(OUT_DTYPE)
    return x.to(OUT_DTYPE)


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, part_out_ptr, part_lse_ptr,
    scale, softcap, k_scale, v_scale, window, page_size, partition,
    stride_qb, stride_qh,
    stride_kp, stride_ko, stride_kh, stride_vp, stride_vo, stride_vh,
    stride_bt, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, KV_SCALED: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One (sequence, KV head, context partition): the group's query heads against the partition's
    keys; writes the partition's normalized output and its log-sum-exp (-inf when it saw no key)."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    start = split * partition
    end = tl.minimum(start + partition, seq_len)
    if USE_WINDOW:  # the query at seq_len - 1 sees positions >= seq_len - window
        start = tl.maximum(start, seq_len - window)
    g = tl.arange(0, GROUP_PAD)
    g_mask = g < GROUP
    heads = kv_head * GROUP + g
    d = tl.arange(0, D_PAD)
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    table = block_tables_ptr + b.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):  # every block holds >= 1 visible key: no all-masked row
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        page = tl.load(table + pos // page_size, mask=valid, other=0).to(tl.int64)
        off = (pos % page_size).to(tl.int64)
        k = _load_kv(k_cache_ptr, page, off, kv_head, d, valid, d_mask, stride_kp, stride_ko, stride_kh, k_scale,
                     KV_SCALED, q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        if USE_SOFTCAP:
            s = softcap * _tanh(s / softcap)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        v = _load_kv(v_cache_ptr, page, off, kv_head, d, valid, d_mask, stride_vp, stride_vo, stride_vh, v_scale,
                     KV_SCALED, q.dtype)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    seen = l_i > 0
    out = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    tl.store(part_out_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :], out,
             mask=g_mask[:, None] & d_mask[None, :])
    tl.store(part_lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, num_splits,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr,
):
    """One (sequence, head): combine the partitions' outputs weighted by exp(lse - max lse)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    s_mask = s < num_splits
    d = tl.arange(0, D_PAD)
    d_mask = d < HEAD_DIM
    lse = tl.load(part_lse_ptr + b * stride_lb + h * stride_lh + s, mask=s_mask, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, 0))  # empty partitions: exp(-inf) = 0
    part = tl.load(part_out_ptr + b * stride_pb + h * stride_ph + s[:, None] * stride_ps + d[None, :],
                   mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(w[:, None] * part, 0) / tl.sum(w, 0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out, mask=d_mask)


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr, out_ptr,
    scale, softcap, k_scale, v_scale, window, page_size,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kp, stride_ko, stride_kh, stride_vp, stride_vo, stride_vh, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, KV_SCALED: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One (sequence, query head, block of query rows): the rows (positions ctx + r, ctx the cached
    prefix) against the sequence's pages up to their own position, causal, optionally windowed."""
    seq = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_ptr + seq + 1).to(tl.int32) - q_start
    if mb * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    ctx = seq_len - q_len
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    q_pos = ctx + rows
    d = tl.arange(0, D_PAD)
    d_mask = d < HEAD_DIM
    tokens = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    kv_head = h // GROUP
    hi = tl.minimum(seq_len, ctx + (mb + 1) * BLOCK_M)  # the block's last row sees up to its position
    lo = 0
    if USE_WINDOW:  # its first row sees nothing before ctx + mb * BLOCK_M - window + 1
        lo = tl.maximum(0, ctx + mb * BLOCK_M - window + 1)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < hi
        page = tl.load(table + pos // page_size, mask=valid, other=0).to(tl.int64)
        off = (pos % page_size).to(tl.int64)
        k = _load_kv(k_cache_ptr, page, off, kv_head, d, valid, d_mask, stride_kp, stride_ko, stride_kh, k_scale,
                     KV_SCALED, q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        if USE_SOFTCAP:
            s = softcap * _tanh(s / softcap)
        visible = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        v = _load_kv(v_cache_ptr, page, off, kv_head, d, valid, d_mask, stride_vp, stride_vo, stride_vh, v_scale,
                     KV_SCALED, q.dtype)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    seen = l_i > 0
    out = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
    tl.store(out_ptr + tokens[:, None] * stride_ot + h * stride_oh + d[None, :], out,
             mask=row_mask[:, None] & d_mask[None, :])


def _pad(n: int) -> int:
    """Next power of two, at least 16 (tl.dot's smallest tile side)."""
    return max(16, triton.next_power_of_2(n))


def default_block(head_dim: int, dtype: torch.dtype) -> int:
    """Rows / keys per tile: 64, or 32 when a [64, head dim] tile passes 16 KiB (fp32 past 64 dims,
    16-bit past 128), which would overflow shared memory with the loop's pipelining."""
    return 64 if _pad(head_dim) * dtype.itemsize <= 256 else 32


def _precision(dtype: torch.dtype) -> str | None:
    """IEEE fp32 dots for fp32 inputs (tl.dot would use TF32); the default for 16-bit ones."""
    return "ieee" if dtype == torch.float32 else None


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int) -> None:
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("triton attention needs a unit stride along the head dim of q and the caches")
    if k_cache.shape[-1] != q.shape[-1] or num_heads % k_cache.shape[2]:
        raise ValueError(f"q heads {num_heads} x dim {q.shape[-1]} do not fit a cache of "
                         f"{k_cache.shape[2]} KV heads x dim {k_cache.shape[-1]}")


def _scaled(k_cache: torch.Tensor) -> bool:
    """fp8 caches hold K / k_scale (V / v_scale); other cache dtypes hold K, V as they are."""
    return k_cache.dtype in _FP8


@functools.lru_cache(maxsize=None)
def _multiprocessors() -> int:
    """SMs of the current CUDA device (8 under the CPU interpreter)."""
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count \
        if torch.cuda.is_available() else 8


def default_num_splits(batch: int, kv_heads: int, max_seq_len: int, block_n: int) -> int:
    """Partitions per sequence so that about 2 programs per streaming multiprocessor run (one when the
    batch alone fills the device), never a partition shorter than one key block."""
    sms = _multiprocessors()
    wanted = max(1, (2 * sms) // max(1, batch * kv_heads))
    return max(1, min(wanted, triton.cdiv(max_seq_len, block_n), 128))


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, max_seq_len: int, scale: float, out: torch.Tensor | None = None, *,
    sliding_window: int | None = None, logit_softcap: float | None = None, k_scale: float = 1.0,
    v_scale: float = 1.0, num_splits: int | None = None, block_n: int | None = None,
) -> torch.Tensor:
    """Paged decode attention, split-K (flash-decoding): one query token per sequence.

    q: [B, H, D] (unit last stride); k_cache, v_cache: [pages, page_size, Hkv, D], in q's dtype, another
    dtype (converted on load), or fp8 holding K / k_scale and V / v_scale (multiplied back on load);
    block_tables: [B, max_blocks] int page ids; seq_lens: [B] int keys per sequence (the query is the
    last position); max_seq_len: max(seq_lens), a host int (it sizes the grid without a device sync).
    Query head h reads KV head h // (H // Hkv). sliding_window: the query at p sees keys
    (p - window, p]; logit_softcap: scores become
    cap * tanh(s / cap) after scaling. num_splits: context partitions per sequence (default: enough
    programs to fill the device), each a program per (sequence, KV head) whose partial softmax a
    reduce kernel combines. block_n: keys per loop iteration (default by head dim and dtype).
    Returns out ([B, H, D], written in place when given)."""
    _check(q, k_cache, v_cache, q.shape[1])
    b, h, d = q.shape
    block_n = block_n or default_block(d, q.dtype)
    hkv, page_size = k_cache.shape[2], k_cache.shape[1]
    out = torch.empty_like(q) if out is None else out
    if b == 0:
        return out
    splits = num_splits or default_num_splits(b, hkv, max_seq_len, block_n)
    partition = triton.cdiv(triton.cdiv(max_seq_len, splits), block_n) * block_n
    splits = triton.cdiv(max_seq_len, partition)
    if splits == 1:  # the partition's normalized output is the answer: write it straight into out
        part_out, part_lse = out.unsqueeze(2), torch.empty(b, h, 1, dtype=torch.float32, device=q.device)
    else:
        part_out = torch.empty(b, h, splits, d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(b, h, splits, dtype=torch.float32, device=q.device)
    group = h // hkv
    _decode_split_kernel[(b, hkv, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part_out, part_lse,
        float(scale), float(logit_softcap or 0.0), float(k_scale), float(v_scale), int(sliding_window or 0),
        page_size, partition,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), block_tables.stride(0), part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        GROUP=group, GROUP_PAD=_pad(group), HEAD_DIM=d, D_PAD=_pad(d), BLOCK_N=block_n,
        USE_WINDOW=sliding_window is not None, USE_SOFTCAP=logit_softcap is not None,
        KV_SCALED=_scaled(k_cache), PRECISION=_precision(q.dtype),
    )
    if splits > 1:
        _decode_reduce_kernel[(b, h)](
            part_out, part_lse, out, splits,
            part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
            out.stride(0), out.stride(1),
            HEAD_DIM=d, D_PAD=_pad(d), S_PAD=triton.next_power_of_2(splits),
        )
    return out


def prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int, scale: float,
    out: torch.Tensor | None = None, *, sliding_window: int | None = None, logit_softcap: float | None = None,
    k_scale: float = 1.0, v_scale: float = 1.0, block_m: int | None = None, block_n: int | None = None,
) -> torch.Tensor:
    """Causal prefill over a ragged batch whose K/V (cached prefix and new tokens) are in the paged cache.

    q: [T, H, D] flat tokens (unit last stride); sequence i owns rows query_start_loc[i] :
    query_start_loc[i + 1] (absolute offsets into q and out), which are the last positions of its
    seq_lens[i] keys, so row r of a chunk of n sees keys up to seq_lens[i] - n + r. block_tables,
    seq_lens, query_start_loc ([S + 1]) cover the same S sequences; max_query_len (host int) sizes
    the grid. Caches, scales, sliding_window and logit_softcap as in `decode_attention`. Only the
    rows of these sequences are written into out ([T, H, D], allocated when not given). block_m /
    block_n: query rows per program / keys per loop iteration (default by head dim and dtype)."""
    _check(q, k_cache, v_cache, q.shape[1])
    num_seqs = seq_lens.shape[0]
    h, d = q.shape[1], q.shape[2]
    block_m = block_m or default_block(d, q.dtype)
    block_n = block_n or default_block(d, q.dtype)
    out = torch.empty_like(q) if out is None else out
    if num_seqs == 0 or max_query_len == 0:
        return out
    hkv, page_size = k_cache.shape[2], k_cache.shape[1]
    _prefill_kernel[(num_seqs, h, triton.cdiv(max_query_len, block_m))](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
        float(scale), float(logit_softcap or 0.0), float(k_scale), float(v_scale), int(sliding_window or 0),
        page_size, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), block_tables.stride(0),
        GROUP=h // hkv, HEAD_DIM=d, D_PAD=_pad(d), BLOCK_M=block_m, BLOCK_N=block_n,
        USE_WINDOW=sliding_window is not None, USE_SOFTCAP=logit_softcap is not None,
        KV_SCALED=_scaled(k_cache), PRECISION=_precision(q.dtype),
    )
    return out
