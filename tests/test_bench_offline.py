"""`fw bench latency` / `fw bench throughput`: the exact-length prompt maker, and whole runs on the tiny
GQA model, fw against transformers, through the CLI entry point."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from fw.commands.bench import BenchError, machine_speed
from fw.commands.bench.offline import exact_length_ids, make_prompts, ratios, throughput_lengths
from fw.commands.bench.plot import read_html_data
from fw.cli.main import main


@pytest.mark.parametrize("length", [1, 2, 7, 16, 100, 333])
def test_exact_length_ids_have_the_length_asked(tokenizer, length):
    ids = exact_length_ids(tokenizer, length, random.Random(length))
    assert len(ids) == length and all(isinstance(i, int) for i in ids)


def test_prompts_are_seeded_and_distinct(tokenizer):
    a = make_prompts(tokenizer, [20, 20, 50], seed=3)
    assert a == make_prompts(tokenizer, [20, 20, 50], seed=3)
    assert [len(p) for p in a] == [20, 20, 50]
    assert a[0] != a[1]  # no shared prompt: a prefix cache must not flatter the run
    assert a != make_prompts(tokenizer, [20, 20, 50], seed=4)


def test_exact_length_ids_rejects_nonpositive(tokenizer):
    with pytest.raises(BenchError):
        exact_length_ids(tokenizer, 0, random.Random(0))


def test_throughput_lengths_span_the_range():
    lengths = throughput_lengths(110, 0.82, 2000, seed=0)
    assert min(lengths) == 19 and max(lengths) == 201
    with pytest.raises(BenchError):
        throughput_lengths(110, 1.5, 4, seed=0)


def test_ratios_are_fw_over_baseline():
    assert ratios({"a": 6.0, "b": None}, {"a": 3.0, "b": 1.0}, ["a", "b"]) == {"a": 2.0, "b": None}
    assert ratios({"a": 1.0}, None, ["a"]) is None


def _run(args, tmp_path, capsys) -> dict:
    out = tmp_path / "result.json"
    assert main([*args, "--output-json", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "fw/transf" in printed
    return {**json.loads(out.read_text()), "_printed": printed}


def test_latency_against_transformers(gqa_dir, tmp_path, capsys, isolated_plugins):
    report = _run(["bench", "latency", "--model", str(gqa_dir), "--dtype", "float32", "--input-len", "16",
                   "--output-len", "8", "--num-iters", "1", "--num-iters-warmup", "0", "--baseline", "transformers",
                   "--num-kv-blocks", "64"], tmp_path, capsys)
    assert report["benchmark"] == "latency" and report["dtype"] == "float32"
    assert report["workload"]["input_len"] == 16 and report["workload"]["output_len"] == 8
    for side in ("fw", "baseline"):
        assert report[side]["ttft_ms"] > 0 and report[side]["decode_tok_s"] > 0 and report[side]["e2e_ms"] > 0
        assert report[side]["output_tokens"] == 8
    for key in ("ttft_ms", "decode_tok_s", "e2e_ms"):
        assert report["ratios"][key] == pytest.approx(report["fw"][key] / report["baseline"][key])
    env = report["environment"]
    assert env["torch_version"] and env["transformers_version"] and env["fw_version"] and env["num_threads"] >= 1
    machine = env["machine"]  # the machine's speed beside the run, before and after it
    assert machine["device_name"]
    for when in ("before", "after"):
        assert machine[when]["matmul_gflops"] > 0 and machine[when]["read_gbs"] > 0
    assert f"float32 matmul {machine['before']['matmul_gflops']:.0f} GFLOP/s" in report["_printed"]
    assert report["baseline_info"]["dtype"] == "float32"


def test_machine_name_tells_cpu_generations_apart(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
                       "model name\t: AMD EPYC\n\nprocessor\t: 1\ncpu family\t: 26\nmodel\t\t: 2\n"
                       "model name\t: other\n")
    assert machine_speed.device_name(torch.device("cpu"), str(cpuinfo)) == "AMD EPYC (family 25, model 17)"
    assert machine_speed.device_name(torch.device("cpu"), str(tmp_path / "missing"))  # the platform's name


def test_throughput_against_transformers(gqa_dir, tmp_path, capsys, isolated_plugins):
    report = _run(["bench", "throughput", "--model", str(gqa_dir), "--dtype", "float32", "--num-prompts", "6",
                   "--input-len", "20", "--input-len-range", "0.5", "--output-len", "8",
                   "--baseline", "transformers", "--baseline-batch-size", "4", "--num-kv-blocks", "64",
                   "--max-batch-size", "4"], tmp_path, capsys)
    assert report["benchmark"] == "throughput"
    for side in ("fw", "baseline"):
        assert report[side]["output_tokens"] == 6 * 8
        assert report[side]["output_throughput"] > 0 and report[side]["request_throughput"] > 0
        assert 6 * 10 <= report[side]["input_tokens"] <= 6 * 30
    assert report["fw"]["input_tokens"] == report["baseline"]["input_tokens"]
    for key in ("output_throughput", "total_token_throughput", "request_throughput", "elapsed_s"):
        assert report["ratios"][key] == pytest.approx(report["fw"][key] / report["baseline"][key])


def test_throughput_passes_alternate_and_report_the_median(gqa_dir, tmp_path, capsys, isolated_plugins):
    plot = tmp_path / "throughput.html"
    report = _run(["bench", "throughput", "--model", str(gqa_dir), "--dtype", "float32", "--num-prompts", "3",
                   "--input-len", "12", "--input-len-range", "0.5", "--output-len", "4", "--num-passes", "3",
                   "--baseline", "transformers", "--baseline-batch-size", "3", "--num-kv-blocks", "64",
                   "--plot", str(plot)], tmp_path, capsys)
    assert report["workload"]["num_passes"] == 3
    output_panel = read_html_data(plot.read_text())["panels"][0]["data"]["groups"]  # the plot shows the report
    for side, group in zip(("fw", "baseline"), output_panel):
        passes = report["passes"][side]
        assert len(passes) == 3 and all(p["output_tokens"] == 3 * 4 for p in passes)
        assert report[side] == sorted(passes, key=lambda p: p["elapsed_s"])[1]  # the median pass
        assert group["value"] == report[side]["output_throughput"]
        assert group["points"] == [p["output_throughput"] for p in passes]
    assert report["ratios"]["elapsed_s"] == pytest.approx(report["fw"]["elapsed_s"] / report["baseline"]["elapsed_s"])
    drawn = plot.read_text().split("<svg")[1]  # the output-throughput panel as drawn: bars, then each pass's dot
    bars = [float(v) for v in re.findall(r'<rect[^>]* data-value="([^"]+)"', drawn)]
    dots = [float(v) for v in re.findall(r'<circle[^>]* data-value="([^"]+)"', drawn)]
    assert bars == [report["fw"]["output_throughput"], report["baseline"]["output_throughput"]]
    assert dots == [p["output_throughput"] for side in ("fw", "baseline") for p in report["passes"][side]]


def test_num_passes_must_be_positive(gqa_dir, tmp_path, capsys, isolated_plugins):
    code = main(["bench", "throughput", "--model", str(gqa_dir), "--dtype", "float32", "--num-prompts", "2",
                 "--num-passes", "0", "--num-kv-blocks", "32", "--no-progress"])
    assert code != 0 and "--num-passes must be at least 1" in capsys.readouterr().err


def test_fw_alone_has_no_baseline(gqa_dir, tmp_path, capsys, isolated_plugins):
    out = tmp_path / "r.json"
    assert main(["bench", "throughput", "--model", str(gqa_dir), "--dtype", "float32", "--num-prompts", "2",
                 "--input-len", "8", "--input-len-range", "0", "--output-len", "4", "--num-kv-blocks", "32",
                 "--output-json", str(out), "--no-progress"]) == 0
    report = json.loads(out.read_text())
    assert report["baseline"] is None and report["ratios"] is None
    assert report["fw"]["output_tokens"] == 8 and report["fw"]["input_tokens"] == 16
    assert "fw" in capsys.readouterr().out
