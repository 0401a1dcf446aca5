"""Pictures of `fw bench` reports: `--plot FILE.png` (matplotlib, the `bench` extra) or
`--plot FILE.html` (an SVG drawn here, with nothing to install and nothing from outside).

A report becomes a `Figure` first: panels of plain numbers, JSON-ready. Both renderers draw
that figure, and both files carry it whole (the HTML page in a `<script type="application/json"
id="fw-plot-data">` block, the PNG in its `fw-plot-data` text chunk), so what a picture shows can
be read back and checked against the report it came from.

- `fw bench serve`: TTFT, ITL and E2E latency histograms with p50/p90/p99 (and a fw server's start-up
  phases); several reports (`fw bench plot`): throughput and p99s against the rate or concurrency swept;
- `fw bench latency` / `throughput`: one panel per figure, fw's bar beside the baseline's, each pass a dot;
- `fw bench kernels`: achieved GB/s per shape and backend, against the device's peak;
- start-up phases (`{"phases": ...}` or `{"runs": [...]}`): each run's phases stacked.
"""

from __future__ import annotations

import json
import math
import struct
import sys
import textwrap
import zlib
from dataclasses import asdict, dataclass, field
from html import escape
from operator import itemgetter
from pathlib import Path
from typing import Any

from fw.commands.bench import BenchError
from fw.commands.bench.plot_svg import COLORS, fmt, panel_svg

FORMATS = (".png", ".html")
DATA_KEY = "fw-plot-data"  # the PNG text chunk and the HTML script block that hold the figure's data
INSTALL_HINT = "pip install 'fw[bench]'"


@dataclass
class Panel:
    """One chart. kind: "histogram" (values binned, with percentile markers), "bars" (one bar per
    group, each with its passes as points), "grouped" (categories × series, optional reference
    line), "stacked" (categories, each a stack of layers) or "lines" (x/y series)."""

    title: str
    kind: str
    unit: str  # the value axis
    data: dict[str, Any]
    x_label: str = ""


@dataclass
class Figure:
    title: str
    subtitle: str
    panels: list[Panel] = field(default_factory=list)
    source: str = ""  # which benchmark: serve, serve-sweep, latency, throughput, kernels, startup

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# -- the file ---------------------------------------------------------------------------------------------------


def check_target(path: str | Path) -> None:
    """Refuse a plot file fw cannot write before the benchmark runs (not after an hour of it)."""
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise BenchError(f"--plot {path}: give a .png or .html file name (got {suffix or 'no suffix'})")
    if suffix == ".png":
        _matplotlib()


def write_plot(report: dict[str, Any] | list[dict[str, Any]], path: str | Path) -> Figure:
    """Draw `report` (or several `fw bench serve` reports: a sweep) into `path`, PNG or HTML by its suffix."""
    check_target(path)
    figure = figure_for(report)
    if Path(path).suffix.lower() == ".png":
        write_png(figure, path)
    else:
        Path(path).write_text(html_page(figure))
    return figure


def figure_for(report: dict[str, Any] | list[dict[str, Any]]) -> Figure:
    if isinstance(report, list):
        if len(report) == 1:
            return figure_for(report[0])
        if all(is_serve_report(r) for r in report):
            return serve_sweep_figure(report)
        raise BenchError("several reports plot together only when all are `fw bench serve` results (a sweep)")
    kind = report.get("benchmark")
    if kind in ("latency", "throughput"):
        return offline_figure(report)
    if kind == "kernels":
        return kernels_figure(report)
    if kind == "startup" or kind is None and ("phases" in report or "runs" in report):
        return startup_figure(report)
    if is_serve_report(report):
        return serve_figure(report)
    raise BenchError("not a report fw bench can plot (expected the JSON of fw bench serve, latency, throughput "
                     "or kernels)")


def is_serve_report(report: Any) -> bool:
    return isinstance(report, dict) and "ttft_ms" in report and "itl_ms" in report and "benchmark" not in report


def read_reports(paths: list[str]) -> list[dict[str, Any]]:
    reports = []
    for path in paths:
        try:
            reports.append(json.loads(Path(path).read_text()))
        except OSError as exc:
            raise BenchError(f"{path}: cannot read it ({exc.strerror or exc})") from None
        except ValueError as exc:
            raise BenchError(f"{path}: not JSON ({exc})") from None
    return reports


# -- figures from reports ---------------------------------------------------------------------------------------


def histogram(values: list[float], max_bins: int = 30) -> list[list[float]]:
    """[low, high, count] per bin, equal widths over [min, max] (one bin when all values are equal)."""
    if not values:
        return []
    low, high = min(values), max(values)
    if high <= low:
        return [[low, high, len(values)]]
    n = max(1, min(max_bins, math.ceil(math.sqrt(len(values))) + 2))
    width = (high - low) / n
    counts = [0] * n
    for v in values:
        counts[min(n - 1, int((v - low) / width))] += 1
    return [[low + i * width, low + (i + 1) * width, c] for i, c in enumerate(counts)]


SERVE_DISTRIBUTIONS = (  # report key, title, per-request values in ms
    ("ttft_ms", "Time to first token", lambda r: [r["ttft"] * 1000] if r.get("ttft") is not None else []),
    ("itl_ms", "Inter-token latency", lambda r: [gap * 1000 for gap in r.get("itl") or []]),
    ("e2el_ms", "End-to-end latency", lambda r: [r["latency"] * 1000] if r.get("latency") is not None else []),
)


def serve_figure(report: dict[str, Any]) -> Figure:
    if "requests" not in report:
        raise BenchError("this fw bench serve report has no per-request records (`requests`) to plot")
    ok = [r for r in report["requests"] if r.get("success")]
    panels = []
    for key, title, values_of in SERVE_DISTRIBUTIONS:
        values = [v for r in ok for v in values_of(r)]
        stats = report.get(key) or {}
        markers = {name: stats.get(stat) for name, stat in (("p50", "median"), ("p90", "p90"), ("p99", "p99"))
                   if stats.get(stat) is not None}
        panels.append(Panel(f"{title} ({len(values)} values)", "histogram", "count",
                            {"values": values, "bins": histogram(values), "markers": markers}, x_label="ms"))
    cfg = report.get("config", {})
    rate = cfg.get("request_rate", "inf")
    subtitle = (f"{report.get('model')}: {report.get('completed')} of {report.get('num_prompts')} requests, "
                f"rate {rate}/s, concurrency {cfg.get('max_concurrency') or 'unlimited'}; "
                f"{fmt(report.get('output_throughput'))} output tok/s, "
                f"{fmt(report.get('request_throughput'))} req/s")
    startup = report.get("server_startup")
    if startup and startup.get("phases"):
        panels.append(_stacked_startup([("server", startup["phases"])], "Server start-up"))
    return Figure("fw bench serve", subtitle, panels, "serve")


def serve_sweep_figure(reports: list[dict[str, Any]]) -> Figure:
    """Several serve runs that differ in request rate or concurrency: throughput and p99s against it."""
    rates = [r.get("config", {}).get("request_rate") for r in reports]
    concurrencies = [r.get("config", {}).get("max_concurrency") for r in reports]
    if len(set(map(str, concurrencies))) > 1:
        axis, xs = "max concurrency", [c if c is not None else math.inf for c in concurrencies]
    elif len(set(map(str, rates))) > 1:
        axis, xs = "request rate (req/s)", [math.inf if r in (None, "inf") else float(r) for r in rates]
    else:
        raise BenchError("these fw bench serve reports have the same request rate and concurrency: nothing was "
                         "swept (plot them one by one)")
    if any(math.isinf(x) for x in xs):
        finite = [x for x in xs if not math.isinf(x)]
        top = max(finite) * 2 if finite else 1.0
        xs = [top if math.isinf(x) else x for x in xs]  # drawn past the largest finite value
        axis += "; unlimited drawn at " + fmt(top)
    order = sorted(range(len(reports)), key=lambda i: xs[i])

    def series(label: str, key: str, stat: str | None = None) -> dict[str, Any]:
        points = []
        for i in order:
            value = reports[i].get(key)
            value = value.get(stat) if stat and isinstance(value, dict) else value
            if value is not None:
                points.append([xs[i], value])
        return {"label": label, "points": points}

    panels = [
        Panel("Throughput", "lines", "tok/s", {"series": [series("output tok/s", "output_throughput"),
                                                         series("total tok/s", "total_token_throughput")]},
              x_label=axis),
        Panel("p99 latency", "lines", "ms", {"series": [series("p99 TTFT", "ttft_ms", "p99"),
                                                       series("p99 ITL", "itl_ms", "p99"),
                                                       series("p99 TPOT", "tpot_ms", "p99")]}, x_label=axis),
    ]
    return Figure("fw bench serve: sweep", f"{reports[0].get('model')}: {len(reports)} runs", panels,
                  "serve-sweep")


OFFLINE_PANELS = {  # benchmark -> (figure key, title, unit, value of one iteration / pass)
    "latency": (("ttft_ms", "TTFT (median)", "ms", lambda it: it["ttft_s"] * 1000),
                ("decode_tok_s", "Decode (median)", "tok/s", lambda it: it.get("decode_tok_s")),
                ("e2e_ms", "End-to-end (median)", "ms", lambda it: it["e2e_s"] * 1000)),
    "throughput": (("output_throughput", "Output", "tok/s", itemgetter("output_throughput")),
                   ("total_token_throughput", "Total (prompt + output)", "tok/s", itemgetter("total_token_throughput")),
                   ("request_throughput", "Requests", "req/s", itemgetter("request_throughput"))),
}


def offline_figure(report: dict[str, Any]) -> Figure:
    kind = report["benchmark"]
    base_name = (report.get("baseline_info") or {}).get("name") or "baseline"
    sides = [("fw", report["fw"], _passes(report, "fw"))]
    if report.get("baseline"):
        sides.append((base_name, report["baseline"], _passes(report, "baseline")))
    panels = []
    for key, title, unit, value_of in OFFLINE_PANELS[kind]:
        groups = [{"label": label, "value": figures.get(key),
                   "points": [v for v in map(value_of, passes) if v is not None]}
                  for label, figures, passes in sides]
        ratio = (report.get("ratios") or {}).get(key)
        if ratio is not None:
            title += f": fw/{base_name} {ratio:.2f}x"
        panels.append(Panel(title, "bars", unit, {"groups": groups}))
    env = report.get("environment", {})
    w = report.get("workload", {})
    if kind == "latency":
        workload = f"{w.get('input_len')} in / {w.get('output_len')} out, {w.get('num_iters')} iterations"
    else:
        workload = (f"{w.get('num_prompts')} prompts, {w.get('min_input_len')}-{w.get('max_input_len')} in / "
                    f"{w.get('output_len')} out, {w.get('num_passes', 1)} passes")
    subtitle = (f"{Path(str(report.get('model'))).name} ({report.get('dtype')}, {env.get('device')}, "
                f"{env.get('num_threads')} threads); {workload}; bars: the reported figure, dots: each "
                f"{'iteration' if kind == 'latency' else 'pass'}")
    return Figure(f"fw bench {kind}", subtitle, panels, kind)


def _passes(report: dict[str, Any], side: str) -> list[dict[str, Any]]:
    if report["benchmark"] == "latency":
        return (report.get(side) or {}).get("iterations") or []
    return (report.get("passes") or {}).get(side) or [report[side]]


def kernels_figure(report: dict[str, Any]) -> Figure:
    attention = report.get("kind") == "attention"
    keys = ("batch", "context") if attention else ("tokens",)
    results = report.get("results", [])
    shapes = list(dict.fromkeys(tuple(r.get(k) for k in keys) for r in results))
    backends = list(dict.fromkeys(r["backend"] for r in results))
    cells = {(r["backend"], tuple(r.get(k) for k in keys)): r for r in results}

    def label(shape: tuple) -> str:
        return f"batch {shape[0]}, ctx {shape[1]}" if attention else f"{shape[0]} tokens"

    series = []
    for backend in backends:
        rows = [cells.get((backend, shape)) for shape in shapes]
        series.append({"label": backend, "values": [
            r["bandwidth_gbps"] if r is not None and r.get("status") == "ok" else None for r in rows]})
    peak = (report.get("peak") or {}).get("bandwidth_gbps")
    reference = {"label": f"peak {fmt(peak)} GB/s", "value": peak} if peak else None
    title = "Achieved bandwidth" + (" against the device's peak" if peak else " (peak unknown)")
    panel = Panel(title, "grouped", "GB/s", {"categories": [label(s) for s in shapes], "series": series,
                                             "reference": reference})
    subtitle = (f"{report.get('kind')} on {report.get('device_name')} ({report.get('device')}), {report.get('dtype')}; "
                f"peak source: {(report.get('peak') or {}).get('source')}")
    skipped = report.get("skipped") or {}
    if skipped:
        subtitle += "; skipped: " + ", ".join(skipped)
    return Figure(f"fw bench kernels: {report.get('kind')}", subtitle, [panel], "kernels")


def startup_figure(report: dict[str, Any]) -> Figure:
    """Start-up phases: `{"phases": {name: s}}` (one run, e.g. `llm.engine.startup_report.as_dict()`) or
    `{"runs": [{"label": ..., "phases": {...}}, ...]}` (several runs side by side)."""
    runs = report.get("runs") or [{"label": report.get("label", "start-up"), "phases": report.get("phases", {})}]
    panel = _stacked_startup([(r.get("label", f"run {i + 1}"), r.get("phases") or {}) for i, r in enumerate(runs)],
                             "Start-up phases")
    total = ", ".join(f"{r.get('label', i + 1)} {fmt(sum((r.get('phases') or {}).values()))} s"
                      for i, r in enumerate(runs))
    return Figure("fw start-up", f"total: {total}", [panel], "startup")


def _stacked_startup(runs: list[tuple[str, dict[str, float]]], title: str) -> Panel:
    phases = list(dict.fromkeys(name for _, ph in runs for name in ph))
    layers = [{"label": p, "values": [ph.get(p, 0.0) for _, ph in runs]} for p in phases]
    return Panel(title, "stacked", "s", {"categories": [label for label, _ in runs], "layers": layers})


# -- PNG (matplotlib) -------------------------------------------------------------------------------------------


def _matplotlib():
    try:
        import matplotlib  # the optional `bench` extra; imported only to write a PNG
    except ImportError:
        raise BenchError(f"PNG plots need matplotlib: {INSTALL_HINT} (or give an .html file: its plot needs "
                         "nothing installed)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # here: as above, and after choosing the Agg backend

    return plt


def write_png(figure: Figure, path: str | Path) -> None:
    plt = _matplotlib()
    n = len(figure.panels)
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    width = max(7.0, 5.2 * cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width, 4.0 * rows + 0.8), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    for ax, panel in zip(axes.flat, figure.panels):
        _DRAW_MPL[panel.kind](ax, panel)
        ax.set_title(panel.title, fontsize=10)
        ax.set_ylabel(panel.unit)
        if panel.x_label:
            ax.set_xlabel(panel.x_label)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(figure.title + "\n" + textwrap.fill(figure.subtitle, int(width * 14)), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={DATA_KEY: json.dumps(figure.to_json(), allow_nan=False)})
    plt.close(fig)


def _mpl_histogram(ax, panel: Panel) -> None:
    bins = panel.data["bins"]
    if bins:
        ax.bar([b[0] for b in bins], [b[2] for b in bins], width=[max(b[1] - b[0], 1e-9) for b in bins],
               align="edge", color=COLORS[0], edgecolor="white")
    for i, (name, x) in enumerate(panel.data["markers"].items()):
        ax.axvline(x, color=COLORS[1 + i], linestyle="--", linewidth=1, label=f"{name} {fmt(x)} ms")
    if panel.data["markers"]:
        ax.margins(y=0.2)
        ax.legend(fontsize=8, loc="upper right")


def _mpl_bars(ax, panel: Panel) -> None:
    groups = panel.data["groups"]
    for i, g in enumerate(groups):
        if g["value"] is not None:
            ax.bar(i, g["value"], color=COLORS[i % len(COLORS)], width=0.6)
            ax.annotate(fmt(g["value"]), (i + 0.28, max([g["value"], *g["points"]])), ha="right", va="bottom",
                        fontsize=8, xytext=(0, 3), textcoords="offset points")
        points = g["points"]
        offsets = [(j - (len(points) - 1) / 2) * 0.08 for j in range(len(points))]
        ax.scatter([i + o for o in offsets], points, color="black", s=12, zorder=3)
    ax.set_xticks(range(len(groups)), [g["label"] for g in groups])


def _mpl_grouped(ax, panel: Panel) -> None:
    categories = panel.data["categories"]
    series = [s for s in panel.data["series"] if any(v is not None for v in s["values"])]
    width = 0.8 / max(1, len(series))
    for j, s in enumerate(series):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(categories))]
        ax.bar([x for x, v in zip(xs, s["values"]) if v is not None], [v for v in s["values"] if v is not None],
               width=width, color=COLORS[j % len(COLORS)], label=s["label"])
    ref = panel.data.get("reference")
    if ref:
        ax.axhline(ref["value"], color="black", linestyle="--", linewidth=1, label=ref["label"])
    ax.set_xticks(range(len(categories)), categories, rotation=45, ha="right", fontsize=8)
    ax.legend(fontsize=8)


def _mpl_stacked(ax, panel: Panel) -> None:
    categories = panel.data["categories"]
    bottoms = [0.0] * len(categories)
    for j, layer in enumerate(panel.data["layers"]):
        ax.bar(range(len(categories)), layer["values"], bottom=bottoms, color=COLORS[j % len(COLORS)],
               label=layer["label"], width=0.6)
        bottoms = [b + v for b, v in zip(bottoms, layer["values"])]
    for i, total in enumerate(bottoms):
        ax.annotate(f"{fmt(total)} {panel.unit}", (i, total), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(categories)), categories)
    ax.set_xlim(-0.6, len(categories) - 0.4 + 0.9)  # room on the right for the legend
    ax.margins(y=0.1)
    ax.legend(fontsize=8, loc="upper right")


def _mpl_lines(ax, panel: Panel) -> None:
    for j, s in enumerate(panel.data["series"]):
        if s["points"]:
            ax.plot([p[0] for p in s["points"]], [p[1] for p in s["points"]], marker="o",
                    color=COLORS[j % len(COLORS)], label=s["label"])
    ax.legend(fontsize=8)


_DRAW_MPL = {"histogram": _mpl_histogram, "bars": _mpl_bars, "grouped": _mpl_grouped, "stacked": _mpl_stacked,
             "lines": _mpl_lines}


def read_png_data(path: str | Path) -> dict[str, Any]:
    """The figure a PNG written here carries (its `fw-plot-data` text chunk)."""
    data = Path(path).read_bytes()
    if not data.startswith(b"\x89PNG\r\n\x1a\n"):
        raise ValueError(f"{path} is not a PNG file")
    pos = 8
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        pos += 12 + length
        key, _, value = body.partition(b"\0")
        if key.decode("latin-1") != DATA_KEY:
            continue
        if kind == b"tEXt":
            return json.loads(value.decode("latin-1"))
        if kind == b"zTXt":
            return json.loads(zlib.decompress(value[1:]).decode("latin-1"))
        if kind == b"iTXt":  # compression flag, method, language tag\0, translated keyword\0, text
            flag, rest = value[0], value[2:]
            text = rest.split(b"\0", 2)[2]
            return json.loads((zlib.decompress(text) if flag else text).decode("utf-8"))
    raise ValueError(f"{path} carries no {DATA_KEY} chunk")


# -- HTML (an SVG drawn here) -----------------------------------------------------------------------------------


def html_page(figure: Figure) -> str:
    data = json.dumps(figure.to_json(), allow_nan=False).replace("<", "\\u003c")  # cannot close the script block
    panels = "\n".join(f'<figure class="panel">{panel_svg(p)}</figure>' for p in figure.panels)
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{escape(figure.title)}</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 16px; color: #1d1d1b; background: #fff; }}
h1 {{ font-size: 18px; margin: 0 0 4px; }}
p.subtitle {{ color: #555; margin: 0 0 12px; }}
.panels {{ display: flex; flex-wrap: wrap; gap: 12px; }}
figure.panel {{ margin: 0; border: 1px solid #ddd; border-radius: 6px; padding: 4px; }}
svg text {{ font: 11px system-ui, sans-serif; fill: #333; }}
svg text.title {{ font-size: 12px; font-weight: 600; }}
</style>
</head>
<body>
<h1>{escape(figure.title)}</h1>
<p class="subtitle">{escape(figure.subtitle)}</p>
<div class="panels">
{panels}
</div>
<script type="application/json" id="{DATA_KEY}">{data}</script>
</body>
</html>
"""


def read_html_data(text: str) -> dict[str, Any]:
    """The figure an HTML page written here carries."""
    start_tag = f'<script type="application/json" id="{DATA_KEY}">'
    start = text.index(start_tag) + len(start_tag)
    return json.loads(text[start:text.index("</script>", start)])


# -- the command line -------------------------------------------------------------------------------------------

PLOT_HELP = ("Also draw the report into FILE: .png (needs matplotlib: pip install 'fw[bench]') or .html (an SVG "
             "page with the data inline; needs nothing). See docs/bench.md.")


def add_plot_argument(group) -> None:
    group.add_argument("--plot", default=None, metavar="FILE", help=PLOT_HELP)


def plot_after_run(report: dict[str, Any], path: str | None) -> None:
    """`--plot FILE` once the report is written (the file was checked before the run by `check_target`)."""
    if path:
        write_plot(report, path)
        print(f"fw bench: plot written to {path}", file=sys.stderr)
