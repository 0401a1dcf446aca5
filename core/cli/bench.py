"""`fw bench`: benchmarks as commands. `fw bench serve` loads any OpenAI-compatible server."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

NAME = "bench"
HELP = "Benchmarks: `fw bench serve` measures an OpenAI-compatible server (fw, vLLM, TGI, SGLang) under load."


def configure(p: argparse.ArgumentParser) -> None:
    actions = p.add_subparsers(dest="bench_action", metavar="ACTION")
    serve = actions.add_parser(
        "serve", help="Send streaming requests to an OpenAI-compatible server; report TTFT, TPOT, ITL, throughput.",
        description="Send N synthetic streaming requests to an OpenAI-compatible server and report latency "
                    "(TTFT, TPOT, ITL, end-to-end) and throughput. See docs/bench.md.")
    configure_serve(serve)
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


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    if args.bench_action != "serve":
        args._bench_help()
        return 2
    return run_serve(args)


def run_serve(args: argparse.Namespace) -> int:
    """Exit status 0 when at least one request completed, 1 when none did (the numbers mean nothing)."""
    from fw.bench.report import build_report, format_table, write_json
    from fw.bench.serve_load import BenchConfig, api_url, benchmark

    cfg = BenchConfig(
        base_url=args.base_url, endpoint=args.endpoint, model=args.model, api_key=args.api_key,
        num_prompts=args.num_prompts, request_rate=args.request_rate, burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, input_len=args.input_len, input_len_range=args.input_len_range,
        output_len=args.output_len, output_len_range=args.output_len_range, seed=args.seed,
        temperature=args.temperature, ignore_eos=args.ignore_eos, request_timeout=args.request_timeout,
        tokens_per_word=args.tokens_per_word, extra_body=args.extra_body,
    )
    cfg.validate()
    result = asyncio.run(benchmark(cfg, progress=not args.no_progress))
    report = build_report(result)
    if args.result_json:  # first: a reader that closes stdout (`| head`) must not cost the result file
        write_json(report, args.result_json)
    print(f"fw bench serve: {report['model']} at {api_url(cfg.base_url, cfg.endpoint)}; {cfg.num_prompts} prompts, "
          f"rate {cfg.request_rate:g}/s, concurrency {cfg.max_concurrency or 'unlimited'}, "
          f"{result.calibration.tokens_per_word:.2f} tokens/word ({result.calibration.source})", file=sys.stderr)
    print(format_table(report))
    return 0 if report["completed"] else 1
