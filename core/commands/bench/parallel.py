"""One process against tensor parallelism against data parallelism (issue 22): greedy decode throughput of
the same model as TP=1, TP=2 and DP=2 engines, rounds alternating, medians reported.

    python -m fw.commands.bench.parallel --model PATH [--batch-sizes 1,64] [--rounds 3] [--output-len 32]

Each variant is an engine driven the way the server's engine thread drives it (add every request, step
until all finish): `LLMEngine` for TP=1 and TP=2, `fw.distributed.data_parallel.DataParallelEngine` for
DP=2, whose replica 1 steps in a process of its own while replica 0 steps here. Tokens per second count
output tokens over the whole run (prefill included). A model whose heads do not divide by 2 (the bundled
SmolLM2) cannot run at TP=2: give a directory (scripts/make_random_llama.py writes one)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import time

import torch

from fw.commands.bench.offline import exact_length_ids, fw_params
from fw.config import EngineConfig
from fw.distributed.data_parallel import DataParallelEngine
from fw.engine.engine import LLMEngine
from fw.engine.factory import create_engine

VARIANTS = ("tp1", "tp1_1thread", "tp2", "dp2")


def _drive(engine, prompts: list[list[int]], output_len: int) -> float:
    """Seconds to finish every prompt on `engine` (LLMEngine or DataParallelEngine)."""
    params = fw_params(output_len, speculative=False)
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(f"bench-{time.monotonic_ns()}-{i}", None, ids, params)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def _threads(engine, count: int, governed: bool) -> None:
    """Step `engine` with `count` threads; `governed`: as many as its ThreadGovernor allows now (fewer while
    other processes hold cores), the way it runs when serving."""
    governor = getattr(getattr(engine, "runner", None), "governor", None)
    if governor is not None:
        governor.max_threads = count if governed else 1
        governor.threads = governor.applied = min(governor.threads, count) if governed else 1
        count = governor.applied
    torch.set_num_threads(count)


def footprint(engine) -> dict:
    """This process's share of `engine`: its weight bytes and KV-cache bytes per page (over all layers)."""
    engine = getattr(engine, "local", engine)  # a DataParallelEngine: replica 0
    weights = sum(p.numel() * p.element_size() for p in engine.loaded.model.parameters())
    kv = sum(layer.kv_cache.numel() * layer.kv_cache.element_size() for layer in engine.runner.layers)
    return {"weight_bytes": weights, "kv_bytes_per_page": kv // engine.blocks.num_blocks}


def run(model: str, batch_sizes: list[int], rounds: int, input_len: int, output_len: int, options: dict) -> dict:
    config = EngineConfig(model=model, **options)
    one = LLMEngine(config)
    engines = {"tp1": one, "tp1_1thread": one, "tp2": LLMEngine(dataclasses.replace(config, tensor_parallel_size=2)),
               "dp2": DataParallelEngine.start(dataclasses.replace(config, data_parallel_size=2), create_engine)}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    # as each runs when alone; tp1_1thread: the same engine on one thread, which a busy neighbour cannot stall
    # at torch's per-op barrier (DESIGN.md: 2 threads on 2 shared cores fell from 82 to 1 tok/s)
    threads = {"tp1": cores, "tp1_1thread": 1, "tp2": max(1, cores // 2), "dp2": max(1, cores // 2)}
    sizes = {name: footprint(engine) for name, engine in engines.items()}
    rng = random.Random(0)
    prompts = [exact_length_ids(engines["tp1"].tokenizer, input_len, rng) for _ in range(max(batch_sizes))]
    seconds: dict[tuple[str, int], list[float]] = {}
    try:
        for batch in batch_sizes:
            for name, engine in engines.items():  # warm-up: first steps, page allocation
                _threads(engine, threads[name], name == "tp1")
                _drive(engine, prompts[:batch], 4)
        for _ in range(rounds):
            for batch in batch_sizes:
                for name, engine in engines.items():
                    _threads(engine, threads[name], name == "tp1")
                    seconds.setdefault((name, batch), []).append(_drive(engine, prompts[:batch], output_len))
    finally:
        engines["tp2"].cluster.close()
        engines["dp2"].close()
    rows = []
    for batch in batch_sizes:
        row = {"batch": batch}
        for name in VARIANTS:
            median = statistics.median(seconds[(name, batch)])
            row[name] = {"seconds": median, "tok_s": batch * output_len / median,
                         "all_seconds": seconds[(name, batch)]}
        rows.append(row)
    return {"model": model, "input_len": input_len, "output_len": output_len, "rounds": rounds, "rows": rows,
            "per_process": sizes}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="A model whose heads divide by 2 (a directory or GGUF file).")
    p.add_argument("--batch-sizes", default="1,64", help="Comma-separated numbers of requests sent at once.")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-cache-memory", default="512MiB", help="Per engine (per rank, per replica).")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    report = run(args.model, [int(b) for b in args.batch_sizes.split(",")], args.rounds, args.input_len,
                 args.output_len, {"dtype": args.dtype, "kv_cache_memory": args.kv_cache_memory})
    for row in report["rows"]:
        cells = "  ".join(f"{name} {row[name]['tok_s']:8.1f} tok/s ({row[name]['seconds'] * 1e3:7.1f} ms)"
                          for name in VARIANTS)
        print(f"batch {row['batch']:4d}: {cells}")
    for name, size in report["per_process"].items():
        print(f"{name}: {size['weight_bytes'] / 1e6:.1f} MB of weights and {size['kv_bytes_per_page'] / 1024:.0f} KiB "
              f"of KV cache per page in rank 0 / replica 0")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
