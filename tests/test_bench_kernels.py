"""`fw bench kernels` on CPU with toy shapes: the attention and MoE runs write the report's fields,
a backend that cannot run is skipped with its reasons, the decode metadata it builds is the engine's
(sdpa over it equals attention gathered by hand), and the peak table and traffic models."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fw.commands.bench.kernels_attention import AttentionShape, decode_metadata, traffic
from fw.commands.bench.kernels_peaks import known_peak, resolve_peak
from fw.commands.bench.plot import read_html_data
from fw.cli.main import main

ATTENTION = ["bench", "kernels", "--kind", "attention", "--device", "cpu", "--dtype", "float32",
             "--batch-sizes", "1,3", "--context-lens", "17,40", "--num-heads", "4", "--num-kv-heads", "2",
             "--head-dim", "16", "--kv-cache-page-size", "8", "--num-iters", "3", "--num-iters-warmup", "1"]
MOE = ["bench", "kernels", "--kind", "moe", "--device", "cpu", "--dtype", "float32", "--num-tokens", "1,9",
       "--num-experts", "4", "--top-k", "2", "--hidden-size", "32", "--intermediate-size", "48",
       "--num-iters", "3", "--num-iters-warmup", "1"]
ROW_FIELDS = {"backend", "status", "bytes", "flops", "median_us", "min_us", "max_us", "bandwidth_gbps", "tflops",
              "bandwidth_fraction", "flops_fraction"}


def _run(args, tmp_path, capsys) -> tuple[int, dict, str]:
    out = tmp_path / "kernels.json"
    code = main([*args, "--output-json", str(out)])
    return code, json.loads(out.read_text()), capsys.readouterr().out


def test_attention_sdpa_and_cpu_paged(tmp_path, capsys, isolated_plugins):
    from fw.backends.attention import cpu_paged

    plot = tmp_path / "attention.html"
    code, report, table = _run([*ATTENTION, "--backends", "sdpa,cpu_paged", "--peak-bandwidth-gbps", "40",
                                "--plot", str(plot)], tmp_path, capsys)
    assert code == 0
    (panel,) = read_html_data(plot.read_text())["panels"]  # achieved GB/s against the peak
    assert panel["data"]["reference"]["value"] == 40.0
    assert panel["data"]["series"][0]["values"] == [r["bandwidth_gbps"] for r in report["results"]
                                                    if r["backend"] == "sdpa"]
    assert report["benchmark"] == "kernels" and report["kind"] == "attention"
    assert report["device"] == "cpu" and report["dtype"] == "float32"
    assert report["backends"] == ["sdpa", "cpu_paged"]
    assert report["shape"] == {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "page_size": 8}
    assert report["peak"] == {"bandwidth_gbps": 40.0, "tflops": None, "source": "flags"}
    assert report["timing"]["num_iters"] == 3 and report["timing"]["clock"] == "perf_counter"
    ran = ["sdpa"] + ([] if cpu_paged._unavailable() else ["cpu_paged"])
    rows = report["results"]
    assert {(r["backend"], r["batch"], r["context"]) for r in rows} == {
        (b, n, c) for b in ran for n in (1, 3) for c in (17, 40)}
    for r in rows:
        assert r["status"] == "ok" and ROW_FIELDS <= set(r)
        assert r["bytes"] == traffic(r["batch"], r["context"], AttentionShape(4, 2, 16, 8), 4)[0]
        assert r["median_us"] > 0 and r["min_us"] <= r["median_us"] <= r["max_us"]
        assert r["bandwidth_gbps"] == pytest.approx(r["bytes"] / r["median_us"] / 1e3)
        assert r["bandwidth_fraction"] == pytest.approx(r["bandwidth_gbps"] / 40)
        assert r["flops_fraction"] is None  # no FLOP/s peak on CPU unless passed
    assert "Decode attention bandwidth, fraction of peak memory bandwidth" in table
    assert "batch 3" in table and "sdpa" in table


def test_moe_reports_kernels_that_cannot_run_as_skipped(tmp_path, capsys, isolated_plugins):
    code, report, table = _run([*MOE, "--backends", "grouped,triton", "--peak-tflops", "0.5"], tmp_path, capsys)
    assert code == 0 and report["kind"] == "moe"
    assert report["shape"] == {"num_experts": 4, "top_k": 2, "hidden_size": 32, "intermediate_size": 48,
                               "activation": "silu"}
    assert report["backends"] == ["grouped", "triton"]
    reasons = report["skipped"]["triton"]  # CUDA only: skipped on CPU with the spec's own words
    assert any("device 'cpu' not supported" in r for r in reasons)
    assert "skipped triton: device 'cpu' not supported" in table
    rows = {r["tokens"]: r for r in report["results"]}
    assert set(rows) == {1, 9} and all(r["backend"] == "grouped" for r in rows.values())
    for tokens, r in rows.items():
        assert r["status"] == "ok" and ROW_FIELDS <= set(r)
        assert 1 <= r["active_experts"] <= min(4, 2 * tokens)
        assert r["flops"] == 2 * tokens * 2 * 3 * 32 * 48
        assert r["bytes"] == (r["active_experts"] * 3 * 32 * 48 + 2 * tokens * 32) * 4
        assert r["flops_fraction"] == pytest.approx(r["tflops"] / 0.5)
        assert r["bandwidth_fraction"] is None


def test_nothing_runnable_exits_1(tmp_path, capsys, isolated_plugins):
    code, report, _ = _run([*MOE, "--backends", "triton"], tmp_path, capsys)
    assert code == 1 and report["results"] == [] and "triton" in report["skipped"]


def test_bad_flags_are_clear_errors(capsys, isolated_plugins):
    assert main([*ATTENTION, "--backends", "sdpa,nope"]) == 2
    err = capsys.readouterr().err
    assert "no attention_backend plugin named nope" in err and "installed:" in err and "sdpa" in err
    assert main([*ATTENTION, "--num-heads", "3"]) == 2
    assert "--num-heads (3) must be a multiple of --num-kv-heads (2)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*ATTENTION, "--batch-sizes", "1,x"])
    assert "comma-separated" in capsys.readouterr().err


def test_decode_metadata_is_what_the_engine_builds():
    """sdpa over the bench's metadata equals attention over each sequence's pages gathered by hand,
    and the new token's K/V land in the slot of its last position."""
    from fw.backends.attention.sdpa import SdpaBackend

    batch, context, page, heads, kv_heads, dim = 3, 21, 4, 4, 2, 8
    num_blocks = batch * math.ceil(context / page) + 1
    gen = torch.Generator().manual_seed(0)
    meta = decode_metadata(batch, context, page, num_blocks, torch.device("cpu"), gen)
    assert meta.num_decodes == batch and meta.query_lens == [1] * batch and meta.seq_lens == [context] * batch
    assert meta.block_tables.shape == (batch, math.ceil(context / page))
    assert len(set(meta.block_tables.flatten().tolist())) == meta.block_tables.numel()  # no page shared
    cache = torch.randn(SdpaBackend.kv_cache_shape(num_blocks, page, kv_heads, dim))
    meta.backend_state = SdpaBackend.prepare(meta)
    q, k, v = torch.randn(batch, heads, dim), torch.randn(batch, kv_heads, dim), torch.randn(batch, kv_heads, dim)
    out = SdpaBackend(heads, kv_heads, dim, dim ** -0.5).forward(q, k, v, cache, meta)
    for i in range(batch):
        pos = torch.arange(context)
        pages, offsets = meta.block_tables[i][pos // page], pos % page
        keys, values = cache[0][:, pages, offsets], cache[1][:, pages, offsets]  # [Hkv, L, D]
        assert torch.equal(keys[:, -1], k[i]) and torch.equal(values[:, -1], v[i])
        keys, values = keys.repeat_interleave(heads // kv_heads, 0), values.repeat_interleave(heads // kv_heads, 0)
        probs = (torch.einsum("hd,hld->hl", q[i], keys) * dim ** -0.5).softmax(-1)
        torch.testing.assert_close(out[i].reshape(heads, dim), torch.einsum("hl,hld->hd", probs, values))


def test_peak_table_and_flags():
    assert known_peak("NVIDIA H100 80GB HBM3", "bfloat16").bandwidth_gbps == 3350.0
    assert known_peak("NVIDIA H100 PCIe", "bfloat16").bandwidth_gbps == 2000.0
    assert known_peak("NVIDIA H200", "bfloat16").bandwidth_gbps == 4800.0
    assert known_peak("NVIDIA GH200 480GB", "bfloat16").source == "table: GH200"
    assert known_peak("NVIDIA A100-SXM4-80GB", "float16").tflops == 312.0
    assert known_peak("Some Future GPU", "bfloat16") is None
    h100 = resolve_peak("cuda", "NVIDIA H100 80GB HBM3", "bfloat16", None, None)
    assert (h100.bandwidth_gbps, h100.tflops, h100.source) == (3350.0, 989.0, "table: H100")
    mixed = resolve_peak("cuda", "NVIDIA H100 80GB HBM3", "bfloat16", 3000.0, None)
    assert (mixed.bandwidth_gbps, mixed.tflops, mixed.source) == (3000.0, 989.0, "flags + table: H100")
    cpu = resolve_peak("cpu", "NVIDIA H100", "float32", None, None)  # the table is for GPUs only
    assert not cpu.known and "--peak-bandwidth-gbps" in cpu.source
