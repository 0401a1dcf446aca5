"""Attention scenarios run through two backends side by side (the `triton` backend against the `sdpa`
reference), shared by the interpreter cases (CPU, TRITON_INTERPRET=1) and the GPU tests.

A scenario is a batch of sequences, each with `cached` tokens already in the paged cache and `new`
tokens in the step under test. Every sequence gets shuffled, non-consecutive pages, and its K/V go
through each backend's own `forward` (and so its own store and cache layout): a first step prefills
the cached prefixes, a second runs the batch under test (decodes first, as the model runner orders
them). Nothing here imports triton."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fw.layers.attention import AttentionMetadata


@dataclass
class Scenario:
    seqs: list[tuple[int, int]]  # (cached, new) per sequence
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    page_size: int = 4
    sliding_window: int | None = None
    logit_softcap: float | None = None
    dtype: torch.dtype = torch.float32
    kv_dtype: torch.dtype | None = None  # None: the model dtype
    k_scale: float = 1.0
    v_scale: float = 1.0
    q_scale: float = 1.0  # larger queries make peaked softmaxes, where the soft cap bites
    seed: int = 0
    tuning: dict = field(default_factory=dict)  # attributes set on the triton backend instance


def _step_meta(lens: list[tuple[int, int]], tables: list[list[int]], page: int, device) -> AttentionMetadata:
    """Metadata for one step: lens[i] = (computed before, new) of sequence i, in step order."""
    slots, starts, seq_lens = [], [0], []
    for (done, n), table in zip(lens, tables):
        slots.extend(table[p // page] * page + p % page for p in range(done, done + n))
        starts.append(starts[-1] + n)
        seq_lens.append(done + n)
    width = max(len(t) for t in tables)
    block_tables = torch.zeros(len(tables), width, dtype=torch.long)
    for i, t in enumerate(tables):
        block_tables[i, :len(t)] = torch.tensor(t)
    return AttentionMetadata(
        num_decodes=sum(1 for _, n in lens if n == 1),
        query_lens=[n for _, n in lens],
        seq_lens=seq_lens,
        query_start_loc=torch.tensor(starts, device=device),
        seq_lens_tensor=torch.tensor(seq_lens, device=device),
        block_tables=block_tables.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        page_size=page,
    )


def _steps(s: Scenario) -> list[list[tuple[int, int, int]]]:
    """(sequence, computed before, new) per step, decodes first within a step."""
    first = [(i, 0, c) for i, (c, _) in enumerate(s.seqs) if c]
    second = [(i, c, n) for i, (c, n) in enumerate(s.seqs)]
    return [sorted(step, key=lambda e: e[2] != 1) for step in (first, second) if step]


def run(s: Scenario, backend_cls: type, device: str = "cpu") -> list[torch.Tensor]:
    """Each step's attention output [T, H, D] from a fresh instance of backend_cls."""
    gen = torch.Generator().manual_seed(s.seed)
    total = [c + n for c, n in s.seqs]
    width = (s.heads + 2 * s.kv_heads) * s.head_dim
    # one fused "qkv" row per position, as attention layers slice q, k, v out of a fused projection
    qkv = [torch.randn(n, width, generator=gen) for n in total]
    num_pages = sum(-(-n // s.page_size) for n in total) + 3
    order = torch.randperm(num_pages, generator=gen).tolist()
    tables, used = [], 0
    for n in total:
        count = -(-n // s.page_size)
        tables.append(order[used: used + count])
        used += count

    impl = backend_cls(s.heads, s.kv_heads, s.head_dim, s.head_dim ** -0.5, sliding_window=s.sliding_window,
                       logit_softcap=s.logit_softcap)
    impl.k_scale, impl.v_scale = s.k_scale, s.v_scale
    for name, value in s.tuning.items():
        if hasattr(impl, name):
            setattr(impl, name, value)
    shape = backend_cls.kv_cache_shape(num_pages, s.page_size, s.kv_heads, s.head_dim)
    cache = torch.zeros(shape, dtype=s.kv_dtype or s.dtype, device=device)
    outputs = []
    for step in _steps(s):
        meta = _step_meta([(c, n) for _, c, n in step], [tables[i] for i, _, _ in step], s.page_size, device)
        meta.backend_state = backend_cls.prepare(meta)
        rows = torch.cat([qkv[i][c: c + n] for i, c, n in step]).to(device=device, dtype=s.dtype)
        t, hd, kvd = rows.shape[0], s.heads * s.head_dim, s.kv_heads * s.head_dim
        q = (rows[:, :hd] * s.q_scale).view(t, s.heads, s.head_dim)
        k = rows[:, hd: hd + kvd].view(t, s.kv_heads, s.head_dim)
        v = rows[:, hd + kvd:].view(t, s.kv_heads, s.head_dim)
        outputs.append(impl.forward(q, k, v, cache, meta).float().cpu())
    return outputs


def compare(s: Scenario, backend_cls: type, reference_cls: type, device: str = "cpu",
            tol: float = 1e-5) -> list[torch.Tensor]:
    """Run both and assert every step's outputs agree; returns the reference outputs."""
    got, want = run(s, backend_cls, device), run(s, reference_cls, device)
    assert len(got) == len(want)
    for step, (a, b) in enumerate(zip(got, want)):
        assert torch.isfinite(a).all(), f"step {step}: non-finite output"
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m: f"step {step}: {m}")
    return want
