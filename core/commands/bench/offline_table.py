"""The text table `fw bench latency` and `fw bench throughput` print: fw, the baseline and fw/baseline side by
side, under the model, workload and machine lines (the JSON report is fw.commands.bench.offline's)."""

from __future__ import annotations

from typing import Any

from fw.commands.bench import machine_speed
from fw.commands.bench.offline import LATENCY_METRICS, THROUGHPUT_METRICS


def format_table(report: dict[str, Any]) -> str:
    """fw, baseline and fw/baseline side by side."""
    metrics = LATENCY_METRICS if report["benchmark"] == "latency" else THROUGHPUT_METRICS
    base_name = report["baseline_info"]["name"] if report["baseline_info"] else "baseline"
    width = 72
    w = report["workload"]
    env = report["environment"]
    if report["benchmark"] == "latency":
        workload = (f"1 request, {w['input_len']} in / {w['output_len']} out, "
                    f"{w['num_iters']} iterations ({w['num_iters_warmup']} warm-up)")
        if w.get("kind", "random") != "random":
            workload += f"; {w['kind']} prompts"
    else:
        workload = (f"{w['num_prompts']} prompts, {w['min_input_len']}-{w['max_input_len']} in / "
                    f"{w['output_len']} out; baseline batch {w['baseline_batch_size']}")
        if w.get("num_passes", 1) > 1:
            workload += f"; median of {w['num_passes']} alternating passes"
        if w.get("kind", "random") != "random":
            workload += f"; {w['kind']} prompts"
    lines = ["{:=^{w}}".format(f" Offline {report['benchmark'].title()} Benchmark ", w=width),
             f"Model: {report['model']} ({report['dtype']}, {env['device']}, {env['num_threads']} threads)",
             f"Workload: {workload}",
             *([machine_speed.summary_line(env["machine"], report["dtype"])] if env.get("machine") else []),
             "-" * width,
             f"{'metric':<28}{'fw':>14}{base_name:>16}{'fw/' + base_name[:6]:>14}"]

    def cell(value: Any) -> str:
        if value is None:
            return "-"
        return f"{value:.2f}" if isinstance(value, float) else str(value)

    base = report["baseline"] or {}
    ratio = report["ratios"] or {}
    for key, label in metrics:
        lines.append(f"{label:<28}{cell(report['fw'].get(key)):>14}{cell(base.get(key)):>16}"
                     f"{cell(ratio.get(key)):>14}")
    spec = report["fw"].get("speculative")
    if spec:
        lines.append(f"Speculative decoding (fw): {spec['num_drafts']} drafts, {spec['num_accepted_tokens']} of "
                     f"{spec['num_draft_tokens']} draft tokens accepted ({spec['acceptance_rate']:.0%}), "
                     f"{spec['mean_acceptance_length']:.2f} tokens per verify pass")
    lines.append("=" * width)
    return "\n".join(lines)
