"""The `triton` backend's kernels on CPU under TRITON_INTERPRET=1, against the `sdpa` reference at fp32.

Not collected by the main suite (the name has no test_ prefix): TRITON_INTERPRET must be set before
triton is first imported, so tests/test_triton_attention.py runs this module in a fresh pytest
process with it set. Run by hand: `TRITON_INTERPRET=1 pytest tests/triton_interpreter_cases.py`.

Shapes are tiny (head dim 16-24, pages of 4-5 tokens) and tiles small (16 rows and keys, decode
forced into several partitions), so a few dozen keys cross many page, tile and partition
boundaries while the interpreter stays fast."""

from __future__ import annotations

import os
import sys

import pytest
import torch

if "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"
elif os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("triton was imported without TRITON_INTERPRET=1 in this process", allow_module_level=True)

from fw.backends.attention.sdpa import SdpaBackend  # noqa: E402
from fw.backends.attention.triton_backend import TritonBackend  # noqa: E402
from triton_scenarios import Scenario, compare, run  # noqa: E402

SMALL = dict(block_m=16, block_n=16, num_splits=3)

# page 4: 16 is exactly four pages, 17 one past, 7 a partly filled last page; 1 a lone token
DECODES = [(0, 1), (15, 1), (16, 1), (6, 1), (40, 1)]
PREFILLS = [(0, 5), (0, 16), (0, 17), (0, 33)]
CHUNKED = [(8, 5), (16, 16), (13, 20), (3, 2)]  # a cached prefix plus a new chunk (prefix caching, chunked prefill)


@pytest.mark.parametrize("batch,heads,kv_heads", [
    ("decode", 4, 2), ("prefill", 4, 2), ("chunked", 4, 2), ("mixed", 4, 2), ("mixed", 4, 4), ("mixed", 8, 1),
], ids=["decode-gqa", "prefill-gqa", "chunked-gqa", "mixed-gqa", "mixed-mha", "mixed-mqa"])
def test_matches_sdpa(batch, heads, kv_heads):
    seqs = {"decode": DECODES, "prefill": PREFILLS, "chunked": CHUNKED,
            "mixed": DECODES[1:3] + PREFILLS[2:3] + CHUNKED[:2]}[batch]
    compare(Scenario(seqs, heads=heads, kv_heads=kv_heads, tuning=SMALL), TritonBackend, SdpaBackend)


@pytest.mark.parametrize("window,softcap", [(5, None), (1, None), (16, None), (1000, None), (None, 2.0), (6, 3.0)],
                         ids=["window5", "window1", "window-page-multiple", "window-beyond", "softcap2",
                              "window6-softcap3"])
def test_window_and_softcap_match_sdpa(window, softcap):
    s = Scenario(DECODES[1:] + CHUNKED[:3] + PREFILLS[3:], sliding_window=window, logit_softcap=softcap,
                 q_scale=3.0, tuning=SMALL)
    want = compare(s, TritonBackend, SdpaBackend)
    if window in (5, 1, 16) or softcap:  # the feature changes the result, so the comparison could fail
        plain = run(Scenario(s.seqs, q_scale=3.0, tuning=SMALL), SdpaBackend)
        assert max((a - b).abs().max().item() for a, b in zip(want, plain)) > 1e-2


@pytest.mark.parametrize("kv_dtype,k_scale,v_scale", [(torch.float8_e4m3fn, 0.5, 0.25), (torch.float8_e5m2, 1.0, 2.0),
                                                      (torch.bfloat16, 1.0, 1.0)], ids=["fp8_e4m3", "fp8_e5m2", "bf16"])
def test_quantized_kv_cache_matches_sdpa(kv_dtype, k_scale, v_scale):
    """Both backends store the same cache bytes and dequantize them the same way (times the scale)."""
    s = Scenario(DECODES[1:] + CHUNKED[:2] + PREFILLS[:1], kv_dtype=kv_dtype, k_scale=k_scale, v_scale=v_scale,
                 sliding_window=9, tuning=SMALL)
    want = compare(s, TritonBackend, SdpaBackend)
    exact = run(Scenario(s.seqs, sliding_window=9, tuning=SMALL), SdpaBackend)
    assert max((a - b).abs().max().item() for a, b in zip(want, exact)) > 1e-3  # the cache really is lossy


def test_odd_head_dim_and_page_size():
    """Head dim 24 (padded to 32 inside the kernel) and pages of 5 tokens (not a power of two)."""
    s = Scenario(DECODES + CHUNKED[:2] + PREFILLS[2:3], head_dim=24, page_size=5, tuning=SMALL)
    compare(s, TritonBackend, SdpaBackend)


@pytest.mark.parametrize("splits", [1, 2, None], ids=["one-partition", "two", "auto"])
def test_decode_partitions_agree(splits):
    """One partition writes the output directly; several go through the reduce kernel: same result."""
    s = Scenario([(40, 1), (3, 1), (23, 1)], tuning=dict(block_m=16, block_n=16, num_splits=splits))
    compare(s, TritonBackend, SdpaBackend)


def test_default_tiles():
    """The serving tiles (64 rows, 64 keys, automatic partitions) on a batch longer than one tile."""
    s = Scenario([(70, 1), (0, 1), (64, 1), (0, 65), (60, 9)], head_dim=16)
    compare(s, TritonBackend, SdpaBackend)


def test_launchers_read_strided_queries_and_write_in_place():
    """decode_attention / prefill_attention (the functions `fw bench kernels` times) take a q sliced from a
    wider tensor and write into the given out, touching only their own rows."""
    from fw.backends.attention import triton_kernels as tk

    gen = torch.Generator().manual_seed(1)
    pages, page, hkv, h, d = 12, 4, 2, 4, 16
    k_cache = torch.randn(pages, page, hkv, d, generator=gen)
    v_cache = torch.randn(pages, page, hkv, d, generator=gen)
    tables = torch.tensor([[3, 7, 1, 0], [2, 5, 9, 11]])
    lens = torch.tensor([13, 16])
    q = torch.randn(2, h, 2 * d, generator=gen)[..., :d]
    out = torch.full((2, h, d), float("nan"))
    tk.decode_attention(q, k_cache, v_cache, tables, lens, 16, d ** -0.5, out, num_splits=2, block_n=16)
    for b in range(2):  # dense reference per sequence
        pos = torch.arange(int(lens[b]))
        keys = k_cache[tables[b][pos // page], pos % page].repeat_interleave(h // hkv, 1)  # [L, H, D]
        values = v_cache[tables[b][pos // page], pos % page].repeat_interleave(h // hkv, 1)
        probs = (torch.einsum("hd,lhd->hl", q[b], keys) * d ** -0.5).softmax(-1)
        torch.testing.assert_close(out[b], torch.einsum("hl,lhd->hd", probs, values), rtol=1e-5, atol=1e-5)

    flat = torch.randn(7, h, d, generator=gen)
    out = torch.full_like(flat, float("nan"))
    starts = torch.tensor([2, 5, 7])  # rows 0-1 belong to someone else: left untouched
    tk.prefill_attention(flat, k_cache, v_cache, tables, torch.tensor([13, 3]), starts, 3, d ** -0.5, out,
                         block_m=16, block_n=16)
    assert torch.isnan(out[:2]).all() and torch.isfinite(out[2:]).all()
