"""LoRA overhead: greedy decode with a random adapter against the same model without one, in one process,
rounds alternating (base engine, then the LoRA engine's base requests, then its adapter requests, ...),
medians reported; the overhead per token is the difference of the seconds per token.

    python -m fw.commands.bench.lora [--model PATH] [--rank 16] [--batch-sizes 1,64] [--rounds 3]

The default model is the bundled SmolLM2-135M-Instruct GGUF. The adapter is random (A and B both
non-zero, so every adapted layer does its work) on all of the model's attention and MLP projections,
written in PEFT's format next to nothing else (a temporary directory). Tokens per second are those of
the whole `generate` call (prompt and decode), as `fw bench throughput` counts them."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from fw import LLM, LoRARequest
from fw.commands.bench import BenchError
from fw.commands.bench.offline import exact_length_ids, fw_params
from fw.default_model import default_model
from fw.errors import ModelLoadError
from fw.layers.blocks import FUSED_PROJECTIONS
from fw.layers.linear import Linear

VARIANTS = ("base", "lora_engine_base", "adapter")


def write_random_adapter(model, path: str | Path, rank: int, seed: int = 0) -> int:
    """A random PEFT adapter (`adapter_config.json`, `adapter_model.safetensors`) on every linear layer of
    `model` (fw's fused q/k/v and gate/up split back into Hugging Face's module names); the modules written."""
    unfused = {}
    for name, (fused, shard) in FUSED_PROJECTIONS.items():
        unfused.setdefault(fused.strip("."), {})[shard] = name.strip(".")
    gen = torch.Generator().manual_seed(seed)
    tensors, targets = {}, set()
    for layer in model.modules():
        if not isinstance(layer, Linear) or layer.prefix == "lm_head":
            continue
        parent, _, leaf = layer.prefix.rpartition(".")
        names = unfused.get(leaf, {0: leaf})
        for shard, size in enumerate(layer.output_sizes):
            module = f"{parent}.{names[shard]}"
            key = f"base_model.model.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, layer.input_size, generator=gen) / layer.input_size ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(size, rank, generator=gen) * 0.01
            targets.add(names[shard])
    if not tensors:
        raise BenchError("the model has no linear layers to adapt")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(targets), "bias": "none"}))
    return len(tensors) // 2


def run(model: str, rank: int, batch_sizes: list[int], rounds: int, input_len: int, output_lens: dict[int, int],
        engine_options: dict) -> dict:
    base = LLM(model, **engine_options)
    lora = LLM(model, enable_lora=True, max_lora_rank=max(rank, 1), **engine_options)
    folder = tempfile.mkdtemp(prefix="fw-bench-lora-")
    modules = write_random_adapter(lora.engine.loaded.model, folder, rank)
    lora.engine.add_lora("bench", folder)
    adapter = LoRARequest("bench")
    rng = random.Random(0)
    prompts = [exact_length_ids(base.tokenizer, input_len, rng) for _ in range(max(batch_sizes))]
    runs = {"base": lambda p, n: base.generate(p, fw_params(n)),
            "lora_engine_base": lambda p, n: lora.generate(p, fw_params(n)),
            "adapter": lambda p, n: lora.generate(p, fw_params(n), lora_request=adapter)}
    for variant in VARIANTS:  # warm-up: first-call allocations, lazy imports, the adapter's first step
        runs[variant](prompts[:2], 4)
    results = {}
    for batch in batch_sizes:
        batch_prompts, n = prompts[:batch], output_lens.get(batch, 32)
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for _ in range(rounds):
            for variant in VARIANTS:
                start = time.perf_counter()
                outs = runs[variant](batch_prompts, n)
                times[variant].append(time.perf_counter() - start)
                if sum(len(o.outputs[0].token_ids) for o in outs) != batch * n:
                    raise BenchError(f"{variant}: expected {batch * n} tokens")
        tokens = batch * n
        row = {v: {"seconds": statistics.median(t), "tok_s": tokens / statistics.median(t), "all_seconds": t}
               for v, t in times.items()}
        base_s, adapter_s = row["base"]["seconds"], row["adapter"]["seconds"]
        row.update(tokens=tokens, output_len=n,
                   adapter_overhead_ms_per_token=(adapter_s - base_s) / tokens * 1000,
                   adapter_time_ratio=adapter_s / base_s,
                   lora_engine_base_time_ratio=row["lora_engine_base"]["seconds"] / base_s)
        results[str(batch)] = row
    return {"model": model, "rank": rank, "adapted_modules": modules, "input_len": input_len, "rounds": rounds,
            "dtype": str(lora.engine.loaded.dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
            "batches": results}


def _batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"--batch-sizes {text!r}: give positive integers separated by commas, "
                                         f"e.g. 1,64")
    return sizes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fw.commands.bench.lora", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="Model (default: the bundled SmolLM2-135M-Instruct GGUF).")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch-sizes", type=_batch_sizes, default=[1, 64])
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=None,
                   help="Tokens per request (default: 64 at batch 1, 32 at larger batches).")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    try:
        model = args.model or default_model()
    except ModelLoadError as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.rank < 1 or args.rounds < 1:
        p.error("--rank and --rounds must be at least 1")
    lens = {b: args.output_len or (64 if b == 1 else 32) for b in args.batch_sizes}
    options = {"dtype": args.dtype, **({"num_kv_blocks": args.num_kv_blocks} if args.num_kv_blocks else {})}
    report = run(model, args.rank, args.batch_sizes, args.rounds, args.input_len, lens, options)
    print(f"rank-{report['rank']} adapter on {report['adapted_modules']} modules, {report['dtype']}, "
          f"{report['threads']} threads, median of {report['rounds']}")
    for batch, row in report["batches"].items():
        print(f"  batch {batch:>3} ({row['output_len']} tokens each): base {row['base']['tok_s']:.1f} tok/s, "
              f"LoRA engine base requests {row['lora_engine_base']['tok_s']:.1f} tok/s, adapter "
              f"{row['adapter']['tok_s']:.1f} tok/s: +{row['adapter_overhead_ms_per_token']:.3f} ms/token, "
              f"{row['adapter_time_ratio']:.2f}x the time")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
