"""The `sdpa` attention backend: torch's scaled_dot_product_attention over the
paged KV cache, on CPU and CUDA. It is the reference other backends are tested
against, so it favours clarity: each step gathers the pages a sequence uses
into a contiguous K/V view; each prefill chunk runs as its own causal
attention (offset by its cached prefix). All decodes run as one padded batch
of grouped matmuls (query heads grouped by their KV head, softmax in fp32):
for one-token queries torch's CPU flash kernel was several times slower in
bf16 and no faster in fp32 (docs/performance.md).

Sliding windows and attention-logit soft-capping follow Hugging Face: a query
at position p sees the keys at positions (p - window, p]; soft-capping
replaces each scaled score s by cap * tanh(s / cap) before masking and softmax.
A layer with neither runs exactly the plain path. Window masks are built once
per step and window size and shared by the layers that use them; a prefill
chunk with a window reads only the keys its queries can see.

KV cache dtypes (--kv-cache-dtype): a cache in another dtype than the model's
is written converted and read back converted to the query dtype; an fp8 cache
(e4m3 or e5m2) stores K / k_scale and V / v_scale saturated to the format's
finite range, and the gathered pages are multiplied back by the scale before
attention, so attention itself still runs in the model dtype."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from fw.layers.attention import AttentionBackend, AttentionMetadata
from fw.plugins import AttentionBackendSpec, Verified, hookimpl

FW_PLUGIN_API_VERSION = "1.2"  # verified_on


@dataclass
class _Prefill:
    start: int  # offset in the flat token dimension
    query_len: int
    seq_len: int
    blocks: torch.Tensor  # page ids covering seq_len
    mask: torch.Tensor | None  # [q, k] bool, None when plain causal (no cached prefix)
    # window -> (first key position the chunk can see, [q, seq_len - first] bool mask); filled lazily
    window_masks: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)
    explicit_mask: torch.Tensor | None = None  # `mask`, or the causal mask None stands for; filled lazily

    def dense_mask(self) -> torch.Tensor:
        """The [q, k] mask written out, for paths that cannot take is_causal."""
        if self.explicit_mask is None:
            self.explicit_mask = self.mask if self.mask is not None else torch.ones(
                self.query_len, self.seq_len, dtype=torch.bool, device=self.blocks.device).tril_()
        return self.explicit_mask

    def window_mask(self, window: int) -> tuple[int, torch.Tensor]:
        """Keys visible to query row r (position seq_len - query_len + r): (pos - window, pos]."""
        if window not in self.window_masks:
            dev = self.blocks.device
            offset = self.seq_len - self.query_len
            first = max(0, offset - window + 1)
            query_pos = torch.arange(self.query_len, device=dev).unsqueeze(1) + offset
            key_pos = torch.arange(first, self.seq_len, device=dev).unsqueeze(0)
            self.window_masks[window] = first, (key_pos <= query_pos) & (key_pos > query_pos - window)
        return self.window_masks[window]


@dataclass
class _State:
    num_decodes: int
    decode_blocks: torch.Tensor | None  # [Bd * max_blocks], flat
    decode_mask: torch.Tensor | None  # [1, Bd, 1, L] bool
    prefills: list[_Prefill]
    decode_rows: torch.Tensor | None = None  # decode_blocks as rows of the cache's 2-D view
    decode_seq_lens: torch.Tensor | None = None  # [Bd], for window masks
    decode_max_len: int = 0
    decode_window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> [1, Bd, 1, L]

    def decode_window_mask(self, window: int) -> torch.Tensor:
        """decode_mask narrowed to the last `window` positions of each sequence."""
        if window not in self.decode_window_masks:
            lens = self.decode_seq_lens
            if self.decode_max_len <= window:  # no sequence is longer than the window yet
                self.decode_window_masks[window] = self.decode_mask
            else:
                positions = torch.arange(self.decode_mask.shape[-1], device=lens.device)
                recent = positions.unsqueeze(0) >= (lens - window).unsqueeze(1)
                self.decode_window_masks[window] = self.decode_mask & recent[None, :, None, :]
        return self.decode_window_masks[window]


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _quantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x in the cache dtype: fp8 values are x / scale, saturated (a plain cast would give NaN or inf)."""
    if dtype not in _FP8:
        return x.to(dtype)
    limit = torch.finfo(dtype).max
    scaled = x.float() if scale == 1.0 else x.float() / scale
    return scaled.clamp_(-limit, limit).to(dtype)


def _dequantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Cache values back in the query dtype (times the scale for fp8)."""
    if x.dtype == dtype:
        return x
    out = x.to(dtype)
    return out.mul_(scale) if x.dtype in _FP8 and scale != 1.0 else out


class SdpaBackend(AttentionBackend):
    # Per-layer K/V scales of an fp8 cache; the loader sets them from the checkpoint (default 1.0).
    k_scale: float = 1.0
    v_scale: float = 1.0

    @staticmethod
    def kv_cache_shape(num_blocks: int, page_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """[2 (K, V), kv heads, pages, page_size, head dim]: head-major, so the pages of a sequence
        gather into [Hkv, L, D] with one index_select and no transposed copy."""
        return (2, num_kv_heads, num_blocks, page_size, head_dim)

    @classmethod
    def prepare(cls, meta: AttentionMetadata) -> _State:
        p = meta.page_size
        d = meta.num_decodes
        decode_blocks = decode_mask = lens = None
        longest = 0
        if d:
            longest = max(meta.seq_lens[:d])
            used = -(-longest // p)
            decode_blocks = meta.block_tables[:d, :used].reshape(-1)
            positions = torch.arange(used * p, device=meta.block_tables.device)
            lens = meta.seq_lens_tensor[:d]
            decode_mask = (positions.unsqueeze(0) < lens.unsqueeze(1))[None, :, None, :]
        return _State(d, decode_blocks, decode_mask, cls.prefill_chunks(meta), decode_seq_lens=lens,
                      decode_max_len=longest)

    @staticmethod
    def prefill_chunks(meta: AttentionMetadata) -> list[_Prefill]:
        """The prefill chunks of a step (the sequences after the decode group), each with its pages and mask."""
        p = meta.page_size
        prefills = []
        starts = [0, *itertools.accumulate(meta.query_lens)]  # query_start_loc, from the host (no device sync)
        for i in range(meta.num_decodes, meta.num_seqs):
            q, k = meta.query_lens[i], meta.seq_lens[i]
            blocks = meta.block_tables[i, : -(-k // p)]
            mask = None
            if k != q:  # cached prefix: query row r sees keys up to (k - q + r)
                dev = meta.block_tables.device
                mask = torch.arange(k, device=dev).unsqueeze(0) <= (torch.arange(q, device=dev) + (k - q)).unsqueeze(1)
            prefills.append(_Prefill(starts[i], q, k, blocks, mask))
        return prefills

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        k_cache, v_cache = kv_cache[0], kv_cache[1]  # [Hkv, pages, page_size, D]
        self._store(k_cache, k, self.k_scale, meta.slot_mapping)
        self._store(v_cache, v, self.v_scale, meta.slot_mapping)
        state: _State = meta.backend_state
        out = torch.empty_like(q)
        d = state.num_decodes
        if d:
            if state.decode_rows is None:  # the same for every layer: computed by the first
                state.decode_rows = self._rows(k_cache, state.decode_blocks)
            keys = _dequantize(self._gather(k_cache, state.decode_rows, d), q.dtype, self.k_scale)  # [Hkv, Bd, L, D]
            values = _dequantize(self._gather(v_cache, state.decode_rows, d), q.dtype, self.v_scale)
            mask = state.decode_mask if self.sliding_window is None else state.decode_window_mask(self.sliding_window)
            out[:d] = self._decode(q[:d], keys, values, mask)
        for pf in state.prefills:
            out[pf.start: pf.start + pf.query_len] = self._prefill(q[pf.start: pf.start + pf.query_len],
                                                                   k_cache, v_cache, pf)
        return out

    def _prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pf: _Prefill) -> torch.Tensor:
        """One prefill chunk: q [q, H, D] against its sequence's cached keys -> [q, H, D]."""
        blocks, lo, hi, mask = pf.blocks, 0, pf.seq_len, pf.mask
        if self.sliding_window is not None and pf.seq_len > self.sliding_window:  # else the window cuts nothing
            first, mask = pf.window_mask(self.sliding_window)
            page0 = first // k_cache.shape[2]  # pages wholly before the window are not read
            blocks, lo, hi = blocks[page0:], first - page0 * k_cache.shape[2], hi - page0 * k_cache.shape[2]
        rows = self._rows(k_cache, blocks)
        keys = _dequantize(self._gather(k_cache, rows, 1)[:, 0, lo:hi], q.dtype, self.k_scale)  # [Hkv, k, D]
        values = _dequantize(self._gather(v_cache, rows, 1)[:, 0, lo:hi], q.dtype, self.v_scale)
        keys, values = keys.unsqueeze(0), values.unsqueeze(0)  # [1, Hkv, k, D]
        query = q.transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
        if self.logit_softcap is None:
            attn = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, is_causal=mask is None,
                                                  scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads)
            return attn.squeeze(0).transpose(0, 1)
        return self._softcapped(query[0], keys[0], values[0], pf.dense_mask() if mask is None else mask)

    def _softcapped(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    mask: torch.Tensor) -> torch.Tensor:
        """Attention with soft-capped scores, which torch's sdpa cannot do: q [H, q, D], keys/values
        [Hkv, k, D], mask [q, k] bool -> [q, H, D]. Scores and softmax in fp32, as in `_decode`."""
        h, n, d = q.shape
        grouped = q.reshape(self.num_kv_heads, -1, d)  # heads of one KV head are adjacent: [Hkv, group * q, D]
        scores = torch.matmul(grouped, keys.transpose(-1, -2)).float() * self.scale  # [Hkv, group * q, k]
        scores = self._cap(scores).view(self.num_kv_heads, -1, n, scores.shape[-1])
        probs = scores.masked_fill_(~mask, float("-inf")).softmax(dim=-1).to(q.dtype)
        out = torch.matmul(probs.view(self.num_kv_heads, -1, probs.shape[-1]), values)  # [Hkv, group * q, D]
        return out.view(h, n, d).transpose(0, 1)

    def _cap(self, scores: torch.Tensor) -> torch.Tensor:
        """cap * tanh(scores / cap), in place (Gemma 2's attention-logit soft-capping)."""
        cap = self.logit_softcap
        return scores.div_(cap).tanh_().mul_(cap)

    def _decode(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """One query token per sequence: q [B, H, D], keys/values [Hkv, B, L, D], mask [1, B, 1, L]."""
        b, group = q.shape[0], self.num_heads // self.num_kv_heads
        # head h reads KV head h // group: [Hkv, B, group, D]
        grouped = q.view(b, self.num_kv_heads, group, self.head_dim).transpose(0, 1)
        scores = torch.matmul(grouped, keys.transpose(-1, -2)).float() * self.scale  # [Hkv, B, group, L]
        if self.logit_softcap is not None:
            scores = self._cap(scores)
        probs = scores.masked_fill_(~mask, float("-inf")).softmax(dim=-1).to(q.dtype)
        return torch.matmul(probs, values).transpose(0, 1).reshape(b, self.num_heads, self.head_dim)

    def _store(self, cache: torch.Tensor, x: torch.Tensor, scale: float, slots: torch.Tensor) -> None:
        """New K or V [T, Hkv, D] into their slots of one layer's cache [Hkv, pages, page_size, D]."""
        rows = x.transpose(0, 1)
        if cache.dtype != x.dtype:
            rows = _quantize(rows, cache.dtype, scale)
        if cache.dtype in _FP8:  # torch has no index_copy_ for fp8: move the bytes
            cache, rows = cache.view(torch.uint8), rows.contiguous().view(torch.uint8)
        cache.view(self.num_kv_heads, -1, self.head_dim).index_copy_(1, slots, rows)

    @staticmethod
    def _rows(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """Rows of the cache's 2-D (head * page, page_size * D) view that hold `blocks`, head-major."""
        hkv, pages = cache.shape[0], cache.shape[1]
        return (torch.arange(hkv, device=blocks.device).unsqueeze(1) * pages + blocks).reshape(-1)

    @staticmethod
    def _gather(cache: torch.Tensor, rows: torch.Tensor, batch: int) -> torch.Tensor:
        """Cache rows from `_rows` (`batch` sequences of equally many pages) -> contiguous [Hkv, batch, L, D].

        One index_select over a 2-D view: faster on CPU than index_select along dim 1 of the 4-D
        cache, or advanced indexing (docs/performance.md)."""
        gathered = cache.view(cache.shape[0] * cache.shape[1], -1).index_select(0, rows)
        return gathered.view(cache.shape[0], batch, -1, cache.shape[-1])


@hookimpl
def fw_register_attention_backends(register) -> None:
    register(AttentionBackendSpec(
        name="sdpa",
        backend_cls=SdpaBackend,
        devices=("cpu", "cuda"),
        dtypes=("float32", "bfloat16", "float16"),
        supports_sliding_window=True,
        supports_logit_softcap=True,
        kv_cache_dtypes=("auto", "bfloat16", "fp8_e4m3", "fp8_e5m2"),
        priority=0,
        # GPU: tests/test_*attention*.py -m gpu and the end-to-end runs (docs/attention-backends.md, GPU figures)
        verified_on=(Verified("cpu", by="fw's CPU tests"),
                     Verified("cuda", (9, 0), "NVIDIA H200", "2026-11-25", "scripts/gpu_acceptance.sh")),
        description="torch scaled_dot_product_attention over the paged KV cache (reference backend; "
                    "sliding windows, attention-logit soft-capping, bf16/fp8 KV cache)",
    ))
