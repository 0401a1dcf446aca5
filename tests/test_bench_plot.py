"""`fw bench ... --plot FILE` and `fw bench plot`: each kind of report drawn as a PNG and as an HTML
page, and the data each file carries read back and checked against the report it came from."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fw.commands.bench import BenchError
from fw.commands.bench.offline import latency_summary, ratios, throughput_summary
from fw.commands.bench.plot import (check_target, figure_for, histogram, read_html_data, read_png_data, startup_figure,
                           write_plot)
from fw.commands.bench.plot_svg import nice_ticks
from fw.commands.bench.prompts import Calibration
from fw.commands.bench.report import build_report
from fw.commands.bench.serve_load import BenchConfig, BenchmarkRun, RequestResult

# -- reports, made by the functions the commands use ------------------------------------------------------------


def serve_report(rate: float = float("inf"), concurrency: int | None = 4, scale: float = 1.0) -> dict:
    results = []
    for i in range(12):
        itl = [(0.010 + 0.001 * ((i + j) % 5)) * scale for j in range(7)]
        results.append(RequestResult(i, 64, 8, start=0.01 * i, success=True, status_code=200,
                                     ttft=(0.05 + 0.004 * i) * scale, itl=itl,
                                     latency=(0.05 + 0.004 * i) * scale + sum(itl), output_tokens=8, prompt_tokens=70,
                                     output_tokens_source="usage", finish_reason="length"))
    results.append(RequestResult(12, 64, 8, start=0.2, success=False, status_code=429, error="overloaded"))
    cfg = BenchConfig(base_url="http://127.0.0.1:8000", num_prompts=13, request_rate=rate, max_concurrency=concurrency,
                      api_key="sk-secret")
    report = build_report(BenchmarkRun(cfg, "smol<b>", Calibration(1.3, "default"), results, 0.5 * scale))
    return json.loads(json.dumps(report))  # as read back from --result-json


def latency_report(baseline: bool = True) -> dict:
    fw = latency_summary([{"ttft_s": 0.10 + 0.01 * i, "e2e_s": 1.0 + 0.1 * i, "output_tokens": 32,
                           "decode_tok_s": 40.0 - i} for i in range(3)])
    base = latency_summary([{"ttft_s": 0.2 + 0.02 * i, "e2e_s": 2.0 + 0.1 * i, "output_tokens": 32,
                             "decode_tok_s": 20.0 + i} for i in range(3)]) if baseline else None
    return {"benchmark": "latency", "model": "smol.gguf", "dtype": "bfloat16",
            "workload": {"input_len": 64, "output_len": 32, "num_iters": 3, "num_iters_warmup": 1, "seed": 0},
            "environment": {"device": "cpu", "num_threads": 2}, "fw": fw, "baseline": base,
            "baseline_info": {"name": "transformers"} if baseline else None,
            "ratios": ratios(fw, base, ["ttft_ms", "decode_tok_s", "e2e_ms"]) if baseline else None}


def throughput_report() -> dict:
    fw_passes = [throughput_summary({"elapsed_s": 2.0 + 0.1 * i, "output_tokens": 512}, 16, 900) for i in range(3)]
    base_passes = [throughput_summary({"elapsed_s": 5.0 + 0.3 * i, "output_tokens": 512}, 16, 900) for i in range(3)]
    fw, base = fw_passes[1], base_passes[1]
    keys = ["output_throughput", "total_token_throughput", "request_throughput"]
    return {"benchmark": "throughput", "model": "smol.gguf", "dtype": "bfloat16",
            "workload": {"num_prompts": 16, "min_input_len": 19, "max_input_len": 201, "output_len": 32,
                         "num_passes": 3},
            "environment": {"device": "cpu", "num_threads": 2}, "fw": fw, "baseline": base,
            "baseline_info": {"name": "transformers"}, "ratios": ratios(fw, base, keys),
            "passes": {"fw": fw_passes, "baseline": base_passes}}


def kernels_report() -> dict:
    results = []
    for backend, speed in (("sdpa", 10.0), ("cpu_paged", 25.0)):
        for batch in (1, 8):
            for context in (512, 2048):
                results.append({"backend": backend, "batch": batch, "context": context, "status": "ok",
                                "bandwidth_gbps": speed * batch ** 0.5, "median_us": 100.0})
    results.append({"backend": "triton", "batch": 1, "context": 512, "status": "skipped", "reason": "no GPU"})
    return {"benchmark": "kernels", "kind": "attention", "device": "cpu", "device_name": "EPYC", "dtype": "float32",
            "peak": {"bandwidth_gbps": 40.0, "tflops": None, "source": "flags"}, "skipped": {"triton": ["no GPU"]},
            "results": results}


REPORTS = {"serve": serve_report, "latency": latency_report, "throughput": throughput_report,
           "kernels": kernels_report, "startup": lambda: {"phases": {"import": 1.5, "resolve": 0.2,
                                                                     "load weights": 2.5, "warm-up": 0.4}}}


def panel_data(figure: dict) -> list[dict]:
    return [p["data"] for p in figure["panels"]]


# -- every kind, both formats ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(REPORTS))
def test_html_plot_carries_the_report_data(kind, tmp_path):
    report = REPORTS[kind]()
    out = tmp_path / f"{kind}.html"
    write_plot(report, out)
    text = out.read_text()
    assert text.startswith("<!doctype html>") and text.count("<svg") == len(figure_for(report).panels)
    assert not re.search(r"(src|href)=\"?https?://", text), "the page loads nothing from outside"
    assert "<b>" not in text  # report text is escaped (the serve fixture's model is "smol<b>")
    data = read_html_data(text)
    assert data == json.loads(json.dumps(figure_for(report).to_json()))
    check_against_report(kind, report, data)
    marks = [float(v) for v in re.findall(r'<(?:rect|circle)[^>]* data-value="([^"]+)"', text)]
    assert marks, "the SVG draws the values"


@pytest.mark.parametrize("kind", sorted(REPORTS))
def test_png_plot_carries_the_report_data(kind, tmp_path):
    pytest.importorskip("matplotlib")
    report = REPORTS[kind]()
    out = tmp_path / f"{kind}.png"
    write_plot(report, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    data = read_png_data(out)
    check_against_report(kind, report, data)


def check_against_report(kind: str, report: dict, data: dict) -> None:
    """What the plot shows is what the report says."""
    panels = panel_data(data)
    if kind == "serve":
        ok = [r for r in report["requests"] if r["success"]]
        ttft, itl, e2e = panels
        assert ttft["values"] == pytest.approx([r["ttft"] * 1000 for r in ok])
        assert itl["values"] == pytest.approx([g * 1000 for r in ok for g in r["itl"]])
        assert e2e["values"] == pytest.approx([r["latency"] * 1000 for r in ok])
        for panel, key in ((ttft, "ttft_ms"), (itl, "itl_ms"), (e2e, "e2el_ms")):
            assert panel["markers"] == {"p50": report[key]["median"], "p90": report[key]["p90"],
                                        "p99": report[key]["p99"]}
            assert sum(b[2] for b in panel["bins"]) == len(panel["values"])
    elif kind in ("latency", "throughput"):
        keys = (["ttft_ms", "decode_tok_s", "e2e_ms"] if kind == "latency"
                else ["output_throughput", "total_token_throughput", "request_throughput"])
        for panel, key in zip(panels, keys):
            fw, base = panel["groups"]
            assert (fw["label"], base["label"]) == ("fw", "transformers")
            assert fw["value"] == report["fw"][key] and base["value"] == report["baseline"][key]
            if kind == "throughput":
                assert fw["points"] == [p[key] for p in report["passes"]["fw"]]
                assert base["points"] == [p[key] for p in report["passes"]["baseline"]]
            else:
                assert len(fw["points"]) == len(report["fw"]["iterations"]) == len(base["points"])
        assert f"{report['ratios'][keys[0]]:.2f}x" in data["panels"][0]["title"]
    elif kind == "kernels":
        (panel,) = panels
        assert panel["reference"]["value"] == report["peak"]["bandwidth_gbps"]
        assert [s["label"] for s in panel["series"]] == ["sdpa", "cpu_paged", "triton"]
        ok = [r["bandwidth_gbps"] for r in report["results"] if r["backend"] == "cpu_paged"]
        assert panel["series"][1]["values"] == ok
        assert panel["series"][2]["values"] == [None, None, None, None]  # skipped: no bar
    elif kind == "startup":
        (panel,) = panels
        assert {layer["label"]: layer["values"][0] for layer in panel["layers"]} == report["phases"]


def test_latency_without_a_baseline_has_fw_alone(tmp_path):
    data = read_html_data((write_plot(latency_report(baseline=False), tmp_path / "l.html"), tmp_path / "l.html")[1]
                          .read_text())
    assert all(len(p["data"]["groups"]) == 1 for p in data["panels"])


def test_serve_sweep_plots_throughput_and_p99_against_what_was_swept(tmp_path):
    reports = [serve_report(concurrency=c, scale=s) for c, s in ((8, 1.6), (1, 1.0), (4, 1.2))]
    data = read_html_data((write_plot(reports, tmp_path / "s.html"), tmp_path / "s.html")[1].read_text())
    throughput, p99 = data["panels"]
    assert throughput["x_label"] == "max concurrency"
    output = throughput["data"]["series"][0]["points"]
    assert [x for x, _ in output] == [1, 4, 8]  # sorted by what was swept
    assert [y for _, y in output] == [reports[1]["output_throughput"], reports[2]["output_throughput"],
                                      reports[0]["output_throughput"]]
    assert p99["data"]["series"][0]["points"][0][1] == reports[1]["ttft_ms"]["p99"]
    with pytest.raises(BenchError, match="nothing was swept"):
        figure_for([serve_report(), serve_report()])


# -- pieces ------------------------------------------------------------------------------------------------------


def test_histogram_counts_every_value_once():
    values = [1.0, 2.0, 2.5, 3.0, 10.0]
    bins = histogram(values)
    assert sum(b[2] for b in bins) == 5 and bins[0][0] == 1.0 and bins[-1][1] == 10.0
    assert histogram([4.0, 4.0]) == [[4.0, 4.0, 2]] and histogram([]) == []


def test_nice_ticks_are_round_and_cover_the_range():
    assert nice_ticks(0, 97) == [0, 20, 40, 60, 80, 100]
    assert nice_ticks(0, 1) == [0, 0.2, 0.4, 0.6, 0.8, 1.0]
    ticks = nice_ticks(13.2, 13.9)
    assert ticks[0] <= 13.2 and ticks[-1] >= 13.9


def test_startup_runs_side_by_side():
    figure = startup_figure({"runs": [{"label": "first", "phases": {"import": 2.0, "load weights": 9.0}},
                                      {"label": "second", "phases": {"import": 2.0, "warm-up": 1.0}}]})
    (panel,) = figure.panels
    assert panel.data["categories"] == ["first", "second"]
    assert {layer["label"]: layer["values"] for layer in panel.data["layers"]} == {
        "import": [2.0, 2.0], "load weights": [9.0, 0.0], "warm-up": [0.0, 1.0]}


def test_bad_targets_fail_before_the_run(tmp_path, monkeypatch):
    with pytest.raises(BenchError, match=r"\.png or \.html"):
        check_target(tmp_path / "plot.pdf")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the bench extra were not installed
    with pytest.raises(BenchError, match=r"pip install 'fw\[bench\]'"):
        check_target(tmp_path / "plot.png")
    write_plot(latency_report(), tmp_path / "still.html")  # HTML needs nothing
    with pytest.raises(BenchError, match="not a report"):
        figure_for({"hello": 1})


def test_the_report_has_no_api_key_and_the_plot_neither(tmp_path):
    write_plot(serve_report(), tmp_path / "s.html")
    assert "sk-secret" not in (tmp_path / "s.html").read_text()


def test_fw_bench_plot_command(tmp_path):
    report = tmp_path / "thr.json"
    report.write_text(json.dumps(throughput_report()))
    out = tmp_path / "thr.html"
    done = subprocess.run([sys.executable, "-m", "fw.cli.main", "bench", "plot", str(report), "-o", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert read_html_data(out.read_text())["source"] == "throughput"
    bad = subprocess.run([sys.executable, "-m", "fw.cli.main", "bench", "plot", str(report), "-o",
                          str(tmp_path / "x.svg")], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and ".png or .html" in bad.stderr
    assert Path(out).exists()
