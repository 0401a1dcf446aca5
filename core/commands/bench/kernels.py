"""`fw bench kernels`: attention and MoE microbenchmarks of every installed backend that can run here.

Backends are found through the plugin registries (`attention_backend`, `moe_kernel`); one whose
spec rejects the device, dtype or shape is reported as skipped with its `rejection_reasons`, never
run. Each runnable (backend, shape) is timed (median of N calls after warm-up; kernels_case) and
reported with its achieved bandwidth and FLOP/s from the kind's traffic model, and as fractions of
the device's peak (kernels_peaks) when the peak is known or passed as flags.

Only the CLI glue (`configure`, `run`) is imported when `fw` starts; torch comes in with the run.
"""

from __future__ import annotations

import argparse
import platform
import sys
from typing import Any

from fw.commands.bench import BenchError
from fw.commands.bench.kernels_peaks import resolve_peak
from fw.commands.bench.plot import add_plot_argument, check_target, plot_after_run
from fw.version import __version__

KINDS = ("attention", "moe")
DTYPES = ("bfloat16", "float16", "float32")


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def _name_list(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def configure(p: argparse.ArgumentParser) -> None:
    """The flags of `fw bench kernels` (docs/bench.md)."""
    g = p.add_argument_group("what to measure")
    g.add_argument("--kind", choices=KINDS, default="attention",
                   help="attention: paged decode attention; moe: a MoE layer's experts (default attention).")
    g.add_argument("--backends", type=_name_list, default=None,
                   help="Comma-separated attention backends / MoE kernels (default: every installed one).")
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (cuda when available).")
    g.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="Activation, weight and KV dtype (default bfloat16).")
    g.add_argument("--seed", type=int, default=0, help="Seed of the random inputs and page layouts.")
    a = p.add_argument_group("attention shapes (--kind attention)")
    a.add_argument("--batch-sizes", type=_int_list, default=[1, 32, 128],
                   help="Decode sequences per step (default 1,32,128).")
    a.add_argument("--context-lens", type=_int_list, default=[1024, 8192, 32768],
                   help="Tokens of context per sequence (default 1024,8192,32768).")
    a.add_argument("--num-heads", type=int, default=32, help="Query heads (default 32, Llama-3-8B).")
    a.add_argument("--num-kv-heads", type=int, default=8, help="KV heads (default 8).")
    a.add_argument("--head-dim", type=int, default=128, help="Head dimension (default 128).")
    a.add_argument("--kv-cache-page-size", type=int, default=16, help="Tokens per KV page (default 16).")
    m = p.add_argument_group("MoE shapes (--kind moe)")
    m.add_argument("--num-tokens", type=_int_list, default=[1, 16, 64, 256, 1024, 4096],
                   help="Tokens per call (default 1,16,64,256,1024,4096).")
    m.add_argument("--num-experts", type=int, default=8, help="Experts (default 8, Mixtral-8x7B).")
    m.add_argument("--top-k", type=int, default=2, help="Experts per token (default 2).")
    m.add_argument("--hidden-size", type=int, default=4096, help="Hidden size (default 4096).")
    m.add_argument("--intermediate-size", type=int, default=14336, help="Expert intermediate size (default 14336).")
    m.add_argument("--activation", default="silu", help="Expert activation, an HF hidden_act name (default silu).")
    t = p.add_argument_group("timing and peaks")
    t.add_argument("--num-iters", type=int, default=20, help="Timed calls per case; the median is reported (default 20).")
    t.add_argument("--num-iters-warmup", type=int, default=3, help="Untimed calls first (default 3).")
    t.add_argument("--peak-bandwidth-gbps", type=float, default=None,
                   help="Device memory bandwidth in GB/s (default: the known-device table on GPU; none on CPU).")
    t.add_argument("--peak-tflops", type=float, default=None,
                   help="Device matrix TFLOP/s at --dtype (default: the known-device table on GPU; none on CPU).")
    o = p.add_argument_group("output")
    o.add_argument("--output-json", default=None, help="Write the full report here.")
    add_plot_argument(o)


def _validate(args: argparse.Namespace) -> None:
    positive = {"--num-heads": args.num_heads, "--num-kv-heads": args.num_kv_heads, "--head-dim": args.head_dim,
                "--kv-cache-page-size": args.kv_cache_page_size, "--num-experts": args.num_experts,
                "--top-k": args.top_k, "--hidden-size": args.hidden_size,
                "--intermediate-size": args.intermediate_size, "--num-iters": args.num_iters}
    bad = [f"{flag} {value}" for flag, value in positive.items() if value < 1]
    if args.num_iters_warmup < 0:
        bad.append(f"--num-iters-warmup {args.num_iters_warmup}")
    if bad:
        raise BenchError(f"these must be positive: {', '.join(bad)}")
    if args.num_heads % args.num_kv_heads:
        raise BenchError(f"--num-heads ({args.num_heads}) must be a multiple of --num-kv-heads ({args.num_kv_heads})")
    if args.top_k > args.num_experts:
        raise BenchError(f"--top-k ({args.top_k}) cannot exceed --num-experts ({args.num_experts})")
    for flag, value in (("--peak-bandwidth-gbps", args.peak_bandwidth_gbps), ("--peak-tflops", args.peak_tflops)):
        if value is not None and value <= 0:
            raise BenchError(f"{flag} must be positive, got {value}")


def _device(name: str):
    import torch  # here: torch loads with the run; `fw --help` imports this module's CLI glue

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise BenchError(f"--device {name!r}: {exc}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BenchError(f"--device {name}: no CUDA device here (torch.cuda.is_available() is False); use cpu")
    return device


def _chosen_specs(registry, names: list[str] | None, kind: str) -> list:
    if names is None:
        return sorted(registry, key=lambda s: s.name)
    unknown = [n for n in names if n not in registry.names()]
    if unknown:
        raise BenchError(f"--backends: no {kind} plugin named {', '.join(unknown)}; installed: "
                         f"{', '.join(registry.names()) or 'none'} (`fw plugins list` shows them)")
    return [registry.get(n) for n in names]


def bench_kernels(args: argparse.Namespace, plugins=None, progress=None) -> dict[str, Any]:
    """Run every case and return the JSON-ready report. `progress(line)` is told about each case."""
    import torch  # here: as in _device

    # here: the timing helpers import torch, the plugin manager costs 20 ms; both load with the run
    from fw.commands.bench import machine_speed
    from fw.commands.bench.kernels_case import median, time_call
    from fw.plugins.manager import get_plugin_manager

    _validate(args)
    device = _device(args.device)
    dtype = getattr(torch, args.dtype)
    device_name = machine_speed.device_name(device)
    peak = resolve_peak(device.type, device_name, args.dtype, args.peak_bandwidth_gbps, args.peak_tflops)
    plugins = plugins or get_plugin_manager()
    registry_kind = "attention_backend" if args.kind == "attention" else "moe_kernel"
    specs = _chosen_specs(plugins.registry(registry_kind), args.backends, registry_kind)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None

    if args.kind == "attention":
        from fw.commands.bench import kernels_attention as k  # here: torch; only this kind's run needs it

        shape = k.AttentionShape(args.num_heads, args.num_kv_heads, args.head_dim, args.kv_cache_page_size)
        make_cases = lambda spec: k.attention_cases(spec, device, dtype, shape, args.batch_sizes,  # noqa: E731
                                                    args.context_lens, free, args.seed)
    else:
        from fw.commands.bench import kernels_moe as k  # here: torch; only this kind's run needs it

        shape = k.MoeShape(args.num_experts, args.top_k, args.hidden_size, args.intermediate_size, args.activation)
        make_cases = lambda spec: k.moe_cases(spec, device, dtype, shape, args.num_tokens, free,  # noqa: E731
                                              args.seed)
    req = k.requirements(device, dtype, shape)

    skipped: dict[str, list[str]] = {}
    results: list[dict[str, Any]] = []
    for spec in specs:
        reasons = spec.rejection_reasons(req)
        if reasons:
            skipped[spec.name] = reasons
            if progress:
                progress(f"{spec.name}: skipped ({'; '.join(reasons)})")
            continue
        with torch.inference_mode():
            for case in make_cases(spec):
                results.append(_measure(case, device, args, peak, time_call, median))
                if progress:
                    progress(_progress_line(results[-1]))
                case = None  # noqa: F841  (free the case's tensors before the next is built)
        if device.type == "cuda":
            torch.cuda.empty_cache()

    return {
        "benchmark": "kernels",
        "kind": args.kind,
        "device": str(device),
        "device_name": device_name,
        "dtype": args.dtype,
        "shape": {key: value for key, value in vars(shape).items()},
        "sweep": ({"batch_sizes": args.batch_sizes, "context_lens": args.context_lens} if args.kind == "attention"
                  else {"num_tokens": args.num_tokens}),
        "timing": {"num_iters": args.num_iters, "num_iters_warmup": args.num_iters_warmup,
                   "statistic": "median", "clock": "cuda events" if device.type == "cuda" else "perf_counter"},
        "peak": {"bandwidth_gbps": peak.bandwidth_gbps, "tflops": peak.tflops, "source": peak.source},
        "environment": {"fw_version": __version__, "torch_version": torch.__version__,
                        "python_version": platform.python_version(), "num_threads": torch.get_num_threads()},
        "backends": [s.name for s in specs],
        "skipped": skipped,
        "results": results,
    }


def _measure(case, device, args, peak, time_call, median) -> dict[str, Any]:
    import torch  # here: as in _device

    row: dict[str, Any] = {"backend": case.backend, **case.labels, "bytes": case.bytes, "flops": case.flops,
                           **case.extra}
    if case.skipped:
        return {**row, "status": "skipped", "reason": case.skipped}
    try:
        times = time_call(case.run, device, args.num_iters_warmup, args.num_iters)
    except torch.cuda.OutOfMemoryError as exc:
        return {**row, "status": "skipped", "reason": f"out of device memory: {str(exc).splitlines()[0]}"}
    except Exception as exc:  # a backend that fails on a shape is reported, the others still run
        return {**row, "status": "error", "reason": f"{type(exc).__name__}: {exc}"}
    seconds = median(times)
    gbps = case.bytes / seconds / 1e9
    tflops = case.flops / seconds / 1e12
    return {**row, "status": "ok", "median_us": seconds * 1e6, "min_us": min(times) * 1e6,
            "max_us": max(times) * 1e6, "bandwidth_gbps": gbps, "tflops": tflops,
            "bandwidth_fraction": gbps / peak.bandwidth_gbps if peak.bandwidth_gbps else None,
            "flops_fraction": tflops / peak.tflops if peak.tflops else None}


def _shape_text(row: dict[str, Any]) -> str:
    if "context" in row:
        return f"batch {row['batch']} context {row['context']}"
    return f"tokens {row['tokens']}"


def _progress_line(row: dict[str, Any]) -> str:
    if row["status"] != "ok":
        return f"{row['backend']} {_shape_text(row)}: {row['status']} ({row['reason']})"
    return f"{row['backend']} {_shape_text(row)}: {row['median_us']:.1f} us, {_num(row['bandwidth_gbps'])} GB/s"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _num(value: float) -> str:
    """One decimal for figures of 10 and up, three significant digits below (CPU toy shapes)."""
    return f"{value:.1f}" if value >= 10 else f"{value:.3g}"


def format_table(report: dict[str, Any]) -> str:
    """Every case as a row, then the grid of bandwidth fractions (attention: context x batch)."""
    attention = report["kind"] == "attention"
    peak = report["peak"]
    width = 100
    lines = ["{:=^{w}}".format(f" Kernel Benchmark: {report['kind']} ", w=width),
             f"Device: {report['device_name']} ({report['device']}), {report['dtype']}; shape "
             + ", ".join(f"{k}={v}" for k, v in report["shape"].items()),
             f"Peak: {peak['bandwidth_gbps'] or '-'} GB/s, {peak['tflops'] or '-'} TFLOP/s ({peak['source']}); "
             f"median of {report['timing']['num_iters']} calls ({report['timing']['clock']})"]
    for name, reasons in report["skipped"].items():
        lines.append(f"skipped {name}: {'; '.join(reasons)}")
    lines.append("-" * width)
    keys = ("batch", "context") if attention else ("tokens",)
    head = "".join(f"{k:>9}" for k in keys)
    lines.append(f"{'backend':<14}{head}{'median us':>12}{'GB/s':>10}{'% peak BW':>11}{'TFLOP/s':>10}"
                 f"{'% peak FLOP':>13}")
    for row in report["results"]:
        cells = "".join(f"{row[k]:>9}" for k in keys)
        if row["status"] != "ok":
            lines.append(f"{row['backend']:<14}{cells}  {row['status']}: {row['reason']}")
            continue
        lines.append(f"{row['backend']:<14}{cells}{row['median_us']:>12.1f}{_num(row['bandwidth_gbps']):>10}"
                     f"{_pct(row['bandwidth_fraction']):>11}{_num(row['tflops']):>10}{_pct(row['flops_fraction']):>13}")
    if attention and report["results"]:
        lines += _fraction_grids(report)
    lines.append("=" * width)
    return "\n".join(lines)


def _fraction_grids(report: dict[str, Any]) -> list[str]:
    """Per backend: rows context, columns batch; the fraction of peak bandwidth (GB/s without a peak)."""
    have_peak = report["peak"]["bandwidth_gbps"] is not None
    batches, contexts = report["sweep"]["batch_sizes"], report["sweep"]["context_lens"]
    lines = ["-" * 100, "Decode attention bandwidth, " + ("fraction of peak memory bandwidth" if have_peak
                                                          else "GB/s (no peak known: pass --peak-bandwidth-gbps)")]
    for backend in dict.fromkeys(r["backend"] for r in report["results"]):
        cells = {(r["context"], r["batch"]): r for r in report["results"] if r["backend"] == backend}
        lines.append(f"{backend:<14}{'context':>9}" + "".join(f"{'batch ' + str(b):>12}" for b in batches))
        for c in contexts:
            row = ""
            for b in batches:
                r = cells.get((c, b))
                if r is None or r["status"] != "ok":
                    text = "-" if r is None else r["status"]
                else:
                    text = _pct(r["bandwidth_fraction"]) if have_peak else _num(r["bandwidth_gbps"])
                row += f"{text:>12}"
            lines.append(f"{'':<14}{c:>9}{row}")
    return lines


def run(args: argparse.Namespace) -> int:
    """`fw bench kernels`: progress on stderr, the table on stdout, the report to --output-json."""
    from fw.commands.bench.report import write_json  # here: it imports httpx, which would cost `fw --help` 70 ms

    if args.plot:
        check_target(args.plot)
    report = bench_kernels(args, progress=lambda line: print(line, file=sys.stderr, flush=True))
    if args.output_json:
        write_json(report, args.output_json)
    plot_after_run(report, args.plot)
    print(format_table(report))
    return 0 if any(r["status"] == "ok" for r in report["results"]) else 1
