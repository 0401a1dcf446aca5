"""The `cpu_paged` backend: its C++ decode kernel against a gather + fp32-softmax reference over
ragged, shuffled block tables, then whole engines against transformers, and auto-selection
(picked on CPU, skipped with the reason when it cannot be built)."""

from __future__ import annotations

import pytest
import torch

from conftest import make_llm
from fw import SamplingParams
from fw.backends.attention import cpu_paged
from plugin_fixtures import builtin_manager, greedy, small_llm

pytestmark = pytest.mark.skipif(cpu_paged._unavailable() is not None,
                                reason="no C++ toolchain to build the cpu_paged kernel")


def reference(q, k_cache, v_cache, tables, seq_lens, scale, window=None, softcap=None):
    """Gather each sequence's positions page by page, attend in fp32 (optionally the last `window` positions
    only, and scores soft-capped after scaling)."""
    b, h, d = q.shape
    hkv, _, page, _ = k_cache.shape
    out = torch.empty_like(q)
    for i in range(b):
        pos = torch.arange(int(seq_lens[i]))
        pages, offsets = tables[i][pos // page], pos % page
        keys = k_cache[:, pages, offsets].float().repeat_interleave(h // hkv, 0)  # [H, L, D]
        values = v_cache[:, pages, offsets].float().repeat_interleave(h // hkv, 0)
        scores = torch.einsum("hd,hld->hl", q[i].float(), keys) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        if window:
            scores[:, : max(0, int(seq_lens[i]) - window)] = float("-inf")
        probs = scores.softmax(-1)
        out[i] = torch.einsum("hl,hld->hd", probs, values).to(q.dtype)
    return out


CASES = [  # (dtype, tolerance)
    (torch.float32, 1e-5),
    (torch.bfloat16, 2e-2),
    (torch.float16, 5e-3),
]


@pytest.mark.parametrize("dtype,tol", CASES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(6, 2, 64), (4, 4, 32), (6, 2, 40)], ids=["gqa", "mha", "d40"])
@pytest.mark.parametrize("page", [4, 16])
@pytest.mark.parametrize("batch", [1, 7])
def test_kernel_matches_reference(dtype, tol, heads, kv_heads, head_dim, page, batch):
    gen = torch.Generator().manual_seed(page * 100 + batch)
    num_pages, max_blocks = 48, 12
    k_cache = torch.randn(kv_heads, num_pages, page, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(kv_heads, num_pages, page, head_dim, generator=gen).to(dtype)
    # ragged: one token, exactly one page, a partial last page, several pages
    lens = [1, page, page + 1, 3 * page - 1, 5, 2 * page, 37][:batch] if batch > 1 else [2 * page + 3]
    seq_lens = torch.tensor(lens, dtype=torch.int64)
    tables = torch.zeros(batch, max_blocks, dtype=torch.int64)  # zeros pad beyond the used pages
    for i, n in enumerate(lens):
        used = -(-n // page)
        tables[i, :used] = torch.randperm(num_pages, generator=gen)[:used]  # shuffled, non-consecutive
    # q as a strided view, the way attention layers slice it out of a fused projection
    q = torch.randn(batch, heads, head_dim * 2, generator=gen).to(dtype)[..., :head_dim]
    out = torch.full_like(q, float("nan")).contiguous()
    scale = head_dim ** -0.5
    cpu_paged.paged_decode(q, k_cache, v_cache, tables, seq_lens, scale, out)
    torch.testing.assert_close(out.float(), reference(q, k_cache, v_cache, tables, seq_lens, scale).float(),
                               atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", CASES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("window,softcap", [(5, None), (None, 2.0), (18, 3.0), (1, None), (1000, None)],
                         ids=["window5", "softcap2", "window18-softcap3", "window1", "window-beyond"])
@pytest.mark.parametrize("page", [4, 16])
def test_kernel_window_and_softcap_match_reference(dtype, tol, window, softcap, page):
    gen = torch.Generator().manual_seed(page * 7 + (window or 0))
    num_pages, max_blocks, heads, kv_heads, head_dim = 48, 12, 6, 2, 64
    k_cache = torch.randn(kv_heads, num_pages, page, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(kv_heads, num_pages, page, head_dim, generator=gen).to(dtype)
    lens = [1, page, page + 1, 3 * page - 1, 5, 2 * page, 37]  # windows start mid-page and on page boundaries
    seq_lens = torch.tensor(lens, dtype=torch.int64)
    tables = torch.zeros(len(lens), max_blocks, dtype=torch.int64)
    for i, n in enumerate(lens):
        tables[i, : -(-n // page)] = torch.randperm(num_pages, generator=gen)[: -(-n // page)]
    q = (torch.randn(len(lens), heads, head_dim, generator=gen) * 3).to(dtype)  # large scores: the cap bites
    out = torch.empty_like(q)
    scale = head_dim ** -0.5
    cpu_paged.paged_decode(q, k_cache, v_cache, tables, seq_lens, scale, out, window, softcap)
    want = reference(q, k_cache, v_cache, tables, seq_lens, scale, window, softcap)
    torch.testing.assert_close(out.float(), want.float(), atol=tol, rtol=tol)
    unmasked = reference(q, k_cache, v_cache, tables, seq_lens, scale)
    if window == 5 or softcap:  # the feature changes the result, so the comparison above can fail
        assert (want.float() - unmasked.float()).abs().max() > 10 * tol


# -- whole engines ------------------------------------------------------------------------------------

PROMPTS = ["a", "Hello world", "The engine schedules every request in pages of keys and values.",
           "def add(a, b):\n    return a + b\n\nprint(add(2, 3))"]
NEW_TOKENS = 24


@pytest.mark.parametrize("layout", [{}, {"kv_cache_page_size": 4}], ids=["page16", "page4"])
def test_engine_matches_transformers(layout, gqa_dir, hf_model, tokenizer):
    from test_parity import hf_greedy

    llm = make_llm(gqa_dir, attention_backend="cpu_paged", **layout)
    assert llm.engine.loaded.attention.chosen.name == "cpu_paged"
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True,
                                                   logprobs=1))
    hf = hf_model(gqa_dir)
    for out in outputs:
        tokens, logprobs = hf_greedy(hf, out.prompt_token_ids, NEW_TOKENS)
        got = out.outputs[0]
        assert got.token_ids == tokens, out.prompt
        for entry, token, ref in zip(got.logprobs, got.token_ids, logprobs):
            assert abs(entry[token].logprob - ref[token].item()) < 1e-3


@pytest.mark.usefixtures("isolated_plugins")
def test_auto_picks_cpu_paged_and_falls_back_when_unbuildable(gqa_dir, monkeypatch, tmp_path):
    manager = builtin_manager()
    llm = small_llm(str(gqa_dir), plugins=manager)
    assert llm.engine.loaded.attention.chosen.name == "cpu_paged"
    tokens = llm.generate("hello", greedy(max_tokens=4))[0].outputs[0].token_ids

    # no installed build, no run-time build in the cache, no compiler on PATH (the loaded copy set aside)
    monkeypatch.setenv("FW_CPP_OPS_INSTALLED", "0")
    monkeypatch.setenv("FW_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("fw.kernels.loader._loaded", {})
    monkeypatch.setattr("fw.kernels.loader.shutil.which", lambda name: None)
    fallback = small_llm(str(gqa_dir), plugins=manager)
    assert fallback.engine.loaded.attention.chosen.name == "sdpa"
    assert "no C++ compiler" in " ".join(fallback.engine.loaded.attention.rejected["cpu_paged"])
    assert fallback.generate("hello", greedy(max_tokens=4))[0].outputs[0].token_ids == tokens
