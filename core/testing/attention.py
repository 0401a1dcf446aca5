"""The attention-backend suite: the backend against `reference_attention` over paged layouts.

A case is a short run of steps (a first prefill step writes the cached context through the
backend's own forward, as the engine does; the later step is the scenario: decodes, a chunked
prefill over a cached prefix, or both with a fresh prefill). Context lengths sit on and around
page boundaries, so the last page of a sequence is sometimes full and sometimes partly filled;
pages are handed out out of order and unused cache slots hold stale values, as in a real cache.
Every step's output is compared with the plain reference, in fp32, on the same (rounded) inputs.

The features a case uses (dtype, head and page size, sliding window, soft-cap, KV-cache dtype)
come from what the spec declares; a case the spec's `rejection_reasons` refuses here (a GPU-only
backend on a CPU machine, a missing package) is skipped with those reasons."""

from __future__ import annotations

from typing import Any

import torch

from fw.devices import cuda_capability
from fw.layers.attention import AttentionMetadata
from fw.plugins import AttentionRequirements
from fw.testing.suite import Case, SuiteTest, device_for, stable_seed, worst_difference

OPTIONS = frozenset({"dtypes", "head_sizes", "page_sizes"})

# (atol, rtol) per model dtype: the reference is fp32 on the same rounded inputs
TOLERANCES = {"float32": (2e-4, 2e-4), "bfloat16": (3e-2, 3e-2), "float16": (5e-3, 5e-3)}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
_KV_DTYPES = {"bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
WINDOW = 5
SOFTCAP = 3.0
SCALE_FACTOR = 1.2  # the layer's scale is head_dim ** -0.5 times this: a backend must use the scale it is given


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        sliding_window: int | None = None, logit_softcap: float | None = None) -> torch.Tensor:
    """Causal attention of the last n positions of one sequence, written plainly, in fp32.

    q [n, H, D] are the queries of positions L - n .. L - 1; k, v [L, Hkv, D] the whole context
    (head h reads KV head h // (H // Hkv)). As Hugging Face defines them: soft-capping replaces each
    scaled score s by cap * tanh(s / cap) before masking; with a sliding window a query at position
    p sees the keys at positions (p - window, p]. Returns [n, H, D] float32."""
    n, heads, _ = q.shape
    length, kv_heads, _ = k.shape
    group = heads // kv_heads
    keys = k.float().repeat_interleave(group, dim=1)  # [L, H, D]
    values = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * scale
    if logit_softcap:
        scores = logit_softcap * torch.tanh(scores / logit_softcap)
    query_pos = torch.arange(length - n, length, device=q.device)[:, None]
    key_pos = torch.arange(length, device=q.device)[None, :]
    visible = key_pos <= query_pos
    if sliding_window:
        visible &= key_pos > query_pos - sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), values)


# -- scenarios: each step is a list of (sequence, new tokens); a sequence's context grows step by step --

def scenarios(p: int) -> dict[str, list[list[tuple[int, int]]]]:
    """Steps per scenario for page size p; lengths land on, just before and just after page ends."""
    return {
        # prefill the context, then one decode each: seq_lens p (last page exactly full), p + 1 (one token
        # on a new page), 2p + 2 (partly filled third page)
        "decode": [[(0, p - 1), (1, p), (2, 2 * p + 1)], [(0, 1), (1, 1), (2, 1)]],
        # ragged fresh prompts, one of them a single token (which the engine counts as a decode)
        "prefill": [[(0, 1), (1, p), (2, p + 3), (3, 2 * p - 1)]],
        # a cached prefix that ends mid-page, then a chunk that crosses a page boundary
        "chunked": [[(0, p + 2), (1, p)], [(0, 5), (1, p + 1)]],
        # decodes, a chunked prefill over a cached prefix and a fresh prompt in one step
        "mixed": [[(0, p + 1), (1, 3), (2, 2 * p - 1)], [(0, 1), (1, 1), (2, 4), (3, 5)]],
    }


LAYOUTS = {"gqa": (4, 2), "mha": (2, 2)}  # (query heads, KV heads)


def tests(spec: Any, options: dict) -> list[SuiteTest]:
    device = device_for(spec, options)
    dtypes = [d for d in options.get("dtypes") or spec.dtypes if d in _DTYPES]
    base_dtype = "float32" if "float32" in dtypes else dtypes[0]
    heads = sorted(options.get("head_sizes") or spec.head_sizes or (16,))
    pages = sorted(options.get("page_sizes") or spec.page_sizes or (4, 16))
    pages = sorted({pages[0], pages[-1]})
    head = heads[0]
    cases: list[dict] = []
    for page in pages:
        for name in scenarios(page):
            cases.append(dict(scenario=name, layout="gqa", page=page, head=head, dtype=base_dtype))
    page = pages[0]
    mixed = dict(scenario="mixed", layout="gqa", page=page, head=head, dtype=base_dtype)
    cases.append({**mixed, "layout": "mha"})
    cases += [{**mixed, "dtype": d} for d in dtypes if d != base_dtype]
    cases += [{**mixed, "head": h} for h in heads[1:][-1:]]
    if spec.supports_sliding_window:
        cases += [{**mixed, "window": WINDOW}, {**mixed, "scenario": "chunked", "window": WINDOW}]
    if spec.supports_logit_softcap:
        cases.append({**mixed, "softcap": SOFTCAP})
    if spec.supports_sliding_window and spec.supports_logit_softcap:
        cases.append({**mixed, "layout": "mha", "window": WINDOW, "softcap": SOFTCAP})
    cases += [{**mixed, "kv": kv} for kv in spec.kv_cache_dtypes if kv != "auto"]
    built = [_case(spec, c, device) for c in cases]
    return [SuiteTest("test_matches_reference", lambda case: run_case(spec, case, device), built,
                      "Every step's output equals the plain reference attention within the dtype's tolerance.")]


def _case(spec: Any, c: dict, device: str) -> Case:
    kv = c.get("kv", "auto")
    parts = [c["scenario"], c["layout"]]
    if c.get("window"):
        parts.append(f"window{c['window']}")
    if c.get("softcap"):
        parts.append(f"softcap{c['softcap']:g}")
    parts += [f"page{c['page']}", f"head{c['head']}", _SHORT[c["dtype"]]]
    if kv != "auto":
        parts.append(f"kv_{kv}")
    case_id = "-".join(parts)
    req = AttentionRequirements(device=device, dtype=c["dtype"], head_size=c["head"], page_size=c["page"],
                                sliding_window=c.get("window"), logit_softcap=c.get("softcap"), kv_cache_dtype=kv,
                                capability=cuda_capability(device))
    reasons = spec.rejection_reasons(req)
    if kv != "auto" and kv not in _KV_DTYPES:
        reasons = [*reasons, f"the kit has no reference for KV cache dtype {kv!r}"]
    return Case(case_id, {**c, "kv": kv}, "; ".join(reasons) or None)


def run_case(spec: Any, case: Case, device: str) -> None:
    c = case.data
    p, head = c["page"], c["head"]
    num_heads, num_kv_heads = LAYOUTS[c["layout"]]
    dtype = _DTYPES[c["dtype"]]
    cache_dtype = dtype if c["kv"] == "auto" else _KV_DTYPES[c["kv"]]
    steps = scenarios(p)[c["scenario"]]
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(stable_seed(case.id))

    totals: dict[int, int] = {}
    for step in steps:
        for seq, n in step:
            totals[seq] = totals.get(seq, 0) + n
    # every sequence's Q/K/V for its whole length, rounded to the model dtype up front
    qkv = {s: tuple((torch.randn(n, h, head, generator=gen) * (1.5 if i == 0 else 1.0)).to(dtype)
                    for i, h in enumerate((num_heads, num_kv_heads, num_kv_heads))) for s, n in totals.items()}
    # pages handed out shuffled, page 0 never used (block tables are padded with 0)
    needed = {s: -(-n // p) for s, n in totals.items()}
    num_blocks = sum(needed.values()) + 3
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables: dict[int, list[int]] = {}
    for s in sorted(needed):
        tables[s], order = order[:needed[s]], order[needed[s]:]

    scale = head ** -0.5 * SCALE_FACTOR
    backend = spec.backend_cls(num_heads, num_kv_heads, head, scale, sliding_window=c.get("window"),
                               logit_softcap=c.get("softcap"))
    shape = spec.backend_cls.kv_cache_shape(num_blocks, p, num_kv_heads, head)
    kv_cache = torch.randn(shape, generator=gen).mul_(3.0).to(cache_dtype).to(dev)  # stale values everywhere
    done = {s: 0 for s in totals}
    atol, rtol = TOLERANCES[c["dtype"]]

    for index, step in enumerate(steps):
        step = sorted(step, key=lambda item: item[1] != 1)  # decodes first, as the model runner orders them
        q, k, v, slots, starts = [], [], [], [], [0]
        for s, n in step:
            lo = done[s]
            q.append(qkv[s][0][lo:lo + n])
            k.append(qkv[s][1][lo:lo + n])
            v.append(qkv[s][2][lo:lo + n])
            slots += [tables[s][pos // p] * p + pos % p for pos in range(lo, lo + n)]
            starts.append(starts[-1] + n)
        seq_lens = [done[s] + n for s, n in step]
        width = max(len(tables[s]) for s, _ in step)
        block_tables = torch.zeros(len(step), width, dtype=torch.long)
        for row, (s, _) in enumerate(step):
            block_tables[row, :len(tables[s])] = torch.tensor(tables[s])
        meta = AttentionMetadata(
            num_decodes=sum(1 for _, n in step if n == 1), query_lens=[n for _, n in step], seq_lens=seq_lens,
            query_start_loc=torch.tensor(starts, dtype=torch.long, device=dev),
            seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.long, device=dev),
            block_tables=block_tables.to(dev), slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            page_size=p)
        meta.backend_state = spec.backend_cls.prepare(meta)
        with torch.inference_mode():
            out = backend.forward(torch.cat(q).to(dev), torch.cat(k).to(dev), torch.cat(v).to(dev), kv_cache, meta)
        total = starts[-1]
        if tuple(out.shape) != (total, num_heads, head):
            raise AssertionError(f"{case.id}: step {index + 1} returned shape {tuple(out.shape)}, "
                                 f"expected {(total, num_heads, head)}")
        if out.dtype != dtype:
            raise AssertionError(f"{case.id}: step {index + 1} returned {out.dtype}, expected {dtype}")
        for row, (s, n) in enumerate(step):
            length = seq_lens[row]
            keys, values = qkv[s][1][:length], qkv[s][2][:length]
            if cache_dtype != dtype:  # what a cache of that dtype can hold (scale 1.0)
                keys, values = keys.to(cache_dtype).float(), values.to(cache_dtype).float()
            want = reference_attention(qkv[s][0][length - n:length], keys, values, scale,
                                       c.get("window"), c.get("softcap"))
            got = out[starts[row]:starts[row + 1]].float().cpu()
            worst, flat, ok = worst_difference(got, want, atol, rtol)
            if not ok:
                token, head_index = flat // (num_heads * head), (flat // head) % num_heads
                kind = "decode" if n == 1 and done[s] else "prefill" if not done[s] else "chunked prefill"
                raise AssertionError(
                    f"{case.id}: step {index + 1}, sequence {s} ({kind}, {n} new token(s), seq_len {length}, "
                    f"page size {p}): worst |backend - reference| = {worst:.4g} at position "
                    f"{length - n + token}, head {head_index} (tolerance {atol:g} + {rtol:g}*|ref|; "
                    f"reference value {float(want.reshape(-1)[flat]):.4g}, backend "
                    f"{float(got.reshape(-1)[flat]):.4g})")
        for s, n in step:
            done[s] += n
