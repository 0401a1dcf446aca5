"""`python -m fw.commands.bench.parallel` (issue 22's figures): TP=1, TP=2 and DP=2 engines on the tiny model, one
round; every variant finishes and reports, and rank 0 of TP=2 holds less than one process's weights and
half its KV bytes per page. About 15 s here (a TP worker and a DP replica start)."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_parallel_bench_reports_every_variant_and_per_process_bytes(gqa_dir, tmp_path, capsys):
    from fw.commands.bench.parallel import VARIANTS, main

    out = tmp_path / "report.json"
    assert main(["--model", str(gqa_dir), "--rounds", "1", "--batch-sizes", "1,3", "--output-len", "3",
                 "--dtype", "float32", "--kv-cache-memory", "4MiB", "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [row["batch"] for row in report["rows"]] == [1, 3]
    for row in report["rows"]:
        assert all(row[name]["tok_s"] > 0 for name in VARIANTS)
    sizes = report["per_process"]
    assert sizes["tp2"]["weight_bytes"] < sizes["tp1"]["weight_bytes"] == sizes["dp2"]["weight_bytes"]
    assert sizes["tp2"]["kv_bytes_per_page"] * 2 == sizes["tp1"]["kv_bytes_per_page"]
    assert "batch    3:" in capsys.readouterr().out
