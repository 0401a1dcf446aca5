"""Statistics over a run's request results, as a JSON-ready dict and a printed table.

Latencies are reported in milliseconds and throughputs per second of wall
time (the run's duration: from the first request's scheduled start to the end
of the last request). Failed requests count in `failed` and in `errors`, and
nowhere else: their partial timings would mix two populations.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterable, Sequence

from fw.commands.bench.serve_load import BenchmarkRun, RequestResult

PERCENTILES = (50, 90, 99)
METRICS = (  # key, title, what a value is
    ("ttft_ms", "Time to First Token", "TTFT"),
    ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
    ("itl_ms", "Inter-token Latency", "ITL"),
    ("e2el_ms", "End-to-end Latency", "E2EL"),
)


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile with linear interpolation between closest ranks (numpy's default method).

    Interpolation keeps p99 meaningful for runs of fewer than 100 requests,
    where a nearest-rank p99 would simply be the maximum.
    """
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: Iterable[float]) -> dict[str, float | None]:
    """mean, median, p90, p99 (and std, min, max); all None for no values, so the keys are always there."""
    data = list(values)
    keys = ("mean", "median", "p90", "p99", "std", "min", "max")
    if not data:
        return dict.fromkeys(keys)
    mean = sum(data) / len(data)
    return {
        "mean": mean,
        "median": percentile(data, 50),
        "p90": percentile(data, 90),
        "p99": percentile(data, 99),
        "std": math.sqrt(sum((x - mean) ** 2 for x in data) / len(data)),
        "min": min(data),
        "max": max(data),
    }


def tpot(result: RequestResult) -> float | None:
    """Decode time per token after the first: (e2e - ttft) / (output tokens - 1); None below 2 tokens."""
    if result.ttft is None or result.latency is None or result.output_tokens < 2:
        return None
    return (result.latency - result.ttft) / (result.output_tokens - 1)


def input_tokens(result: RequestResult) -> int:
    """The server's count when its usage reported one, else the length the prompt was built for."""
    return result.prompt_tokens if result.prompt_tokens is not None else result.input_len


def build_report(run: BenchmarkRun) -> dict[str, Any]:
    """Everything a result file holds: configuration, totals, throughputs, latency statistics, errors,
    and per-request records (so other statistics can be computed later without rerunning)."""
    ok = [r for r in run.results if r.success]
    failed = [r for r in run.results if not r.success]
    duration = run.duration
    total_in = sum(input_tokens(r) for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    ms = 1000.0

    def per_s(x: float) -> float:
        return x / duration if duration > 0 else 0.0

    config = asdict(run.config)
    config.pop("api_key", None)  # result files get shared; a key does not belong in them
    config["request_rate"] = _finite(config["request_rate"])
    report: dict[str, Any] = {
        "model": run.model,
        "config": config,
        "tokens_per_word": run.calibration.tokens_per_word,
        "tokens_per_word_source": run.calibration.source,
        "num_prompts": len(run.results),
        "completed": len(ok),
        "failed": len(failed),
        "duration_s": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "input_tokens_source": "usage" if ok and all(r.prompt_tokens is not None for r in ok) else "estimate",
        "output_tokens_source": "usage" if ok and all(r.output_tokens_source == "usage" for r in ok) else "chunks",
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(total_out),
        "total_token_throughput": per_s(total_in + total_out),
        "max_concurrent_requests": max_overlap(ok),
        "ttft_ms": summarize(r.ttft * ms for r in ok if r.ttft is not None),
        "tpot_ms": summarize(t * ms for t in map(tpot, ok) if t is not None),
        "itl_ms": summarize(gap * ms for r in ok for gap in r.itl),
        "e2el_ms": summarize(r.latency * ms for r in ok if r.latency is not None),
        "errors": dict(Counter(r.error or "unknown error" for r in failed).most_common()),
        "server_startup": run.server_startup,
        "requests": [r.to_json() for r in run.results],
    }
    return report


def max_overlap(results: Iterable[RequestResult]) -> int:
    """Most requests in flight at once, from their start and end times (a check on --max-concurrency)."""
    events = []
    for r in results:
        if r.latency is not None:
            events += [(r.start, 1), (r.start + r.latency, -1)]
    best = current = 0
    for _, step in sorted(events, key=lambda e: (e[0], e[1])):  # an end before a start at the same instant
        current += step
        best = max(best, current)
    return best


def _finite(x: float) -> float | str:
    """JSON has no infinity; "inf" reads back with float()."""
    return "inf" if isinstance(x, float) and math.isinf(x) else x


def write_json(report: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")


def format_table(report: dict[str, Any]) -> str:
    """The human summary, laid out like vLLM's benchmark_serving so numbers can be compared by eye."""
    width = 50
    lines = ["{:=^{w}}".format(" Serving Benchmark Result ", w=width)]

    def row(label: str, value: Any, fmt: str = "{:.2f}") -> None:
        text = "-" if value is None else (fmt.format(value) if isinstance(value, float) else str(value))
        lines.append(f"{label:<40}{text:>10}")

    row("Model:", report["model"])
    row("Successful requests:", report["completed"])
    row("Failed requests:", report["failed"])
    row("Benchmark duration (s):", report["duration_s"])
    row("Total input tokens:", report["total_input_tokens"])
    row("Total generated tokens:", report["total_output_tokens"])
    row("Request throughput (req/s):", report["request_throughput"])
    row("Output token throughput (tok/s):", report["output_throughput"])
    row("Total token throughput (tok/s):", report["total_token_throughput"])
    row("Max concurrent requests:", report["max_concurrent_requests"])
    for key, title, short in METRICS:
        lines.append("{:-^{w}}".format(title, w=width))
        stats = report[key]
        row(f"Mean {short} (ms):", stats["mean"])
        row(f"Median {short} (ms):", stats["median"])
        row(f"P90 {short} (ms):", stats["p90"])
        row(f"P99 {short} (ms):", stats["p99"])
    if report["errors"]:
        lines.append("{:-^{w}}".format("Errors", w=width))
        for message, count in report["errors"].items():
            lines.append(f"{count:>6} x {message[:200]}")
    lines.append("=" * width)
    return "\n".join(lines)
