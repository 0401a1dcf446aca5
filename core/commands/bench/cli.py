"""`fw bench`: benchmarks as commands. `fw bench serve` loads any OpenAI-compatible server;
`fw bench latency` and `fw bench throughput` measure fw's engine in-process, optionally against transformers;
`fw bench kernels` times attention backends and MoE kernels alone (fw.commands.bench.kernels); `--plot FILE` on each,
and `fw bench plot` on saved reports, draw them (fw.commands.bench.plot)."""

from __future__ import annotations

import argparse
import json
import sys

from fw.commands.bench.contention import busy_neighbours
from fw.commands.bench.kernels import configure as configure_kernels
from fw.commands.bench.kernels import run as run_kernels
from fw.commands.bench.plot import add_plot_argument, check_target, plot_after_run, read_reports, write_plot
from fw.config import add_config_arguments, resolve_config
from fw.default_model import default_model

NAME = "bench"
HELP = ("Benchmarks: `fw bench serve` measures an OpenAI-compatible server (fw, vLLM, TGI, SGLang) under load; "
        "`fw bench latency` / `fw bench throughput` measure fw in-process against a transformers baseline.")


def configure(p: argparse.ArgumentParser) -> None:
    actions = p.add_subparsers(dest="bench_action", metavar="ACTION")
    serve = actions.add_parser(
        "serve", help="Send streaming requests to an OpenAI-compatible server; report TTFT, TPOT, ITL, throughput.",
        description="Send N synthetic streaming requests to an OpenAI-compatible server and report latency "
                    "(TTFT, TPOT, ITL, end-to-end) and throughput. See docs/bench.md.")
    configure_serve(serve)
    latency = actions.add_parser(
        "latency", help="One request at a time in-process: TTFT, decode tok/s, end-to-end latency.",
        description="Offline latency of fw's engine, one request at a time (medians over iterations), "
                    "optionally against transformers on the same weights. See docs/bench.md.")
    configure_latency(latency)
    throughput = actions.add_parser(
        "throughput", help="All prompts at once in-process: output tok/s, total tok/s, req/s.",
        description="Offline throughput of fw's engine on N prompts submitted at once, optionally against "
                    "transformers generate() in static batches. See docs/bench.md.")
    configure_throughput(throughput)
    kernels = actions.add_parser(
        "kernels", help="Attention and MoE kernel microbenchmarks: time, GB/s, FLOP/s, fraction of the device's peak.",
        description="Time every installed attention backend (paged decode) or MoE kernel that can run on the "
                    "device over a sweep of shapes; report bandwidth and FLOP/s against the device's peak. "
                    "See docs/bench.md.")
    configure_kernels(kernels)
    plot = actions.add_parser(
        "plot", help="Draw saved fw bench reports (JSON) as a PNG or HTML plot; several serve reports: a sweep.",
        description="Draw the JSON report of fw bench serve, latency, throughput or kernels into a PNG or an HTML "
                    "page. Several fw bench serve reports that differ in --request-rate or --max-concurrency plot "
                    "as a sweep: throughput and p99 latencies against it. See docs/bench.md.")
    plot.add_argument("reports", nargs="+", metavar="REPORT",
                      help="JSON files written by --result-json / --output-json.")
    plot.add_argument("--output", "-o", required=True, metavar="FILE", help="The plot: FILE.png or FILE.html.")
    p.set_defaults(_bench_help=p.print_help)


def configure_serve(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("server")
    s.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="Server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted).")
    s.add_argument("--endpoint", default="/v1/completions",
                   help="/v1/completions (default) or /v1/chat/completions.")
    s.add_argument("--model", default=None, help="Model name to send (default: the first id of GET /v1/models).")
    s.add_argument("--api-key", default=None, help="Sent as `Authorization: Bearer KEY`.")
    s.add_argument("--request-timeout", type=float, default=600.0,
                   help="Seconds one request may take in all before it counts as failed (default 600).")
    load = p.add_argument_group("load")
    load.add_argument("--num-prompts", type=int, default=100, help="Requests to send (default 100).")
    load.add_argument("--request-rate", type=float, default=float("inf"),
                      help="Requests per second, Poisson arrivals; inf (default) sends all at once.")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="Shape of the gamma-distributed gaps: 1 (default) is Poisson, <1 burstier, >1 steadier.")
    load.add_argument("--max-concurrency", type=int, default=None,
                      help="Most requests in flight at once (default: no limit).")
    load.add_argument("--seed", type=int, default=0, help="Seed of prompts, lengths and arrival times.")
    req = p.add_argument_group("requests")
    req.add_argument("--input-len", type=int, default=128, help="Prompt length in tokens, approximately (default 128).")
    req.add_argument("--input-len-range", type=float, default=0.0,
                     help="Spread R: prompt lengths uniform in [len*(1-R), len*(1+R)] (default 0).")
    req.add_argument("--output-len", type=int, default=128, help="max_tokens of each request (default 128).")
    req.add_argument("--output-len-range", type=float, default=0.0,
                     help="Spread R: max_tokens uniform in [len*(1-R), len*(1+R)] (default 0).")
    req.add_argument("--temperature", type=float, default=0.0, help="Sampling temperature (default 0, greedy).")
    req.add_argument("--ignore-eos", action="store_true",
                     help="Send ignore_eos and min_tokens=max_tokens (vLLM/fw extensions) so every request "
                          "generates exactly its output length.")
    req.add_argument("--tokens-per-word", type=float, default=None,
                     help="Tokens per prompt word (default: measured with the server's POST /tokenize, else 1.3).")
    req.add_argument("--extra-body", type=_json_object, default={},
                     help='JSON object merged into every request body; a null value removes a key, e.g. '
                          '\'{"stream_options": null}\'.')
    out = p.add_argument_group("output")
    out.add_argument("--result-json", default=None, help="Write the full report (with per-request records) here.")
    out.add_argument("--no-progress", action="store_true", help="No progress bar on stderr.")
    add_plot_argument(out)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    return value


def _configure_offline(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    w = p.add_argument_group("workload")
    w.add_argument("--output-len", type=int, default=128, help="Tokens generated per request (default 128).")
    w.add_argument("--baseline", choices=("none", "transformers", "llama.cpp", "no-speculation"), default="none",
                   help="Also run the workload on transformers (same weights, dtype, prompts), on llama.cpp "
                        "(the same GGUF file: its own benchmark binaries from --llama-cpp-bin or PATH, else the "
                        "llama-cpp-python bindings) or, with "
                        "--speculative-config, on fw without speculation (no-speculation: the same engine, "
                        "requests opted out), taking turns with fw, and print fw/baseline ratios (default none).")
    w.add_argument("--llama-cpp-bin", default=None, metavar="DIR",
                   help="The folder with llama.cpp's llama-bench and llama-batched-bench (--baseline llama.cpp).")
    w.add_argument("--workload", choices=("random", "copy"), default="random",
                   help="Prompts: random words (default), or copy: a passage written out again and again, cut "
                        "mid-passage, so the output repeats it (where speculative decoding's ngram proposer pays).")
    w.add_argument("--contention", type=int, default=0, metavar="N",
                   help="Run N busy neighbour processes (one core each) during the measurement, fw's and the "
                        "baseline's passes alike: the speed on a shared host (default 0).")
    o = p.add_argument_group("output")
    o.add_argument("--output-json", default=None, help="Write fw's figures, the baseline's and their ratios here.")
    o.add_argument("--no-progress", action="store_true", help="No progress bars on stderr.")
    add_plot_argument(o)
    add_config_arguments(p)  # --model, --dtype, --max-batch-size, ... (--seed also seeds the prompts)
    return w


def configure_latency(p: argparse.ArgumentParser) -> None:
    w = _configure_offline(p)
    w.add_argument("--input-len", type=int, default=512, help="Prompt length in tokens, exactly (default 512).")
    w.add_argument("--num-iters", type=int, default=3, help="Measured iterations (default 3).")
    w.add_argument("--num-iters-warmup", type=int, default=1, help="Unmeasured iterations first (default 1).")


def configure_throughput(p: argparse.ArgumentParser) -> None:
    w = _configure_offline(p)
    w.add_argument("--num-prompts", type=int, default=64, help="Prompts submitted at once (default 64).")
    w.add_argument("--input-len", type=int, default=110, help="Mean prompt length in tokens (default 110).")
    w.add_argument("--input-len-range", type=float, default=0.82,
                   help="Spread R: prompt lengths uniform in [len*(1-R), len*(1+R)] (default 0.82: 19-201).")
    w.add_argument("--baseline-batch-size", type=int, default=64,
                   help="Prompts per transformers generate() call (default 64).")
    w.add_argument("--num-passes", type=int, default=1,
                   help="Passes of the workload, fw and the baseline taking turns, each on new prompts; the "
                        "median pass of each is reported (default 1).")


def run(args: argparse.Namespace) -> int:
    if args.bench_action == "serve":
        return run_serve(args)
    if args.bench_action in ("latency", "throughput"):
        return run_offline(args)
    if args.bench_action == "kernels":
        return run_kernels(args)
    if args.bench_action == "plot":
        return run_plot(args)
    args._bench_help()
    return 2


def run_offline(args: argparse.Namespace) -> int:
    # here: the engine, torch and the serve-load helpers load with the run, not with `fw --help`
    from fw.commands.bench import offline, offline_table
    from fw.commands.bench.report import write_json
    from fw.llm import LLM

    config = resolve_config(cli=vars(args), config_file=args.config)
    if args.plot:
        check_target(args.plot)  # before the model loads and the run: a bad name or no matplotlib fails now
    if config.model is None:
        config.model = default_model()
    if args.contention < 0:
        raise SystemExit("fw bench: --contention must be 0 or more")
    llm = LLM(**vars(config))
    common = dict(output_len=args.output_len, baseline=args.baseline, llama_cpp_bin=args.llama_cpp_bin,
                  seed=config.seed, progress=not args.no_progress, workload=args.workload)
    with busy_neighbours(args.contention):
        if args.bench_action == "latency":
            report = offline.bench_latency(llm, input_len=args.input_len, num_iters=args.num_iters,
                                           num_iters_warmup=args.num_iters_warmup, **common)
        else:
            report = offline.bench_throughput(llm, num_prompts=args.num_prompts, input_len=args.input_len,
                                              input_len_range=args.input_len_range,
                                              baseline_batch_size=args.baseline_batch_size,
                                              num_passes=args.num_passes, **common)
    report["workload"]["contention"] = args.contention
    if args.output_json:
        write_json(report, args.output_json)
    plot_after_run(report, args.plot)
    print(offline_table.format_table(report))
    return 0


def run_plot(args: argparse.Namespace) -> int:
    write_plot(read_reports(args.reports), args.output)
    print(f"fw bench: plot written to {args.output}", file=sys.stderr)
    return 0


def run_serve(args: argparse.Namespace) -> int:
    """Exit status 0 when at least one request completed, 1 when none did (the numbers mean nothing)."""
    import asyncio  # here: 30 ms that `fw --help` (which imports this module) does not pay

    # here: the load generator imports httpx, which would cost `fw --help` 70 ms
    from fw.commands.bench.report import build_report, format_table, write_json
    from fw.commands.bench.serve_load import BenchConfig, api_url, benchmark

    cfg = BenchConfig(
        base_url=args.base_url, endpoint=args.endpoint, model=args.model, api_key=args.api_key,
        num_prompts=args.num_prompts, request_rate=args.request_rate, burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, input_len=args.input_len, input_len_range=args.input_len_range,
        output_len=args.output_len, output_len_range=args.output_len_range, seed=args.seed,
        temperature=args.temperature, ignore_eos=args.ignore_eos, request_timeout=args.request_timeout,
        tokens_per_word=args.tokens_per_word, extra_body=args.extra_body,
    )
    cfg.validate()
    if args.plot:
        check_target(args.plot)
    result = asyncio.run(benchmark(cfg, progress=not args.no_progress))
    report = build_report(result)
    if args.result_json:  # first: a reader that closes stdout (`| head`) must not cost the result file
        write_json(report, args.result_json)
    if report["completed"]:
        plot_after_run(report, args.plot)
    elif args.plot:
        print(f"fw bench: no request completed, so no plot ({args.plot} not written)", file=sys.stderr)
    print(f"fw bench serve: {report['model']} at {api_url(cfg.base_url, cfg.endpoint)}; {cfg.num_prompts} prompts, "
          f"rate {cfg.request_rate:g}/s, concurrency {cfg.max_concurrency or 'unlimited'}, "
          f"{result.calibration.tokens_per_word:.2f} tokens/word ({result.calibration.source})", file=sys.stderr)
    print(format_table(report))
    return 0 if report["completed"] else 1
