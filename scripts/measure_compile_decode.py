"""Batch-1 decode of the bundled SmolLM2 with --enable-torch-compile's two paths and eager, in one process,
alternating round by round (docs/compile.md): the buckets' graphs captured ahead of time and loaded from their
files (fw.compile.graphs, what a start uses where torch has aot_compile), the same buckets compiled through
dynamo (the path before, and on a torch without aot_compile), and eager; medians of the rounds, and whether
the three decoded the same tokens.

    python scripts/measure_compile_decode.py [CACHE_DIR] [ROUNDS]    # CACHE_DIR: a temporary folder; ROUNDS: 7
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time

from fw import LLM, SamplingParams
from fw.compile import step as step_module
from fw.default_model import bundled_smollm2

TOKENS = 64
FLAGS = dict(dtype="bfloat16", kv_cache_memory="64MiB", max_batch_size=1, max_batch_input_tokens=32,
             bucket_tokens_min=1)  # tokens 1..32, batch 1: 7 graphs


def main() -> None:
    cache = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 7
    llm = LLM(str(bundled_smollm2()), enable_torch_compile=True, compile_cache_dir=cache, **FLAGS)
    runner = llm.engine.runner
    loaded = runner.compiled
    captured = step_module.available
    step_module.available = lambda: False  # the dynamo path, as on a torch without aot_compile
    try:
        dynamo = step_module.CompiledStep(runner.model, loaded.buckets, "default", loaded.cache)
        dynamo.compile_all()
    finally:
        step_module.available = captured
    variants = {"loaded graphs": loaded, "dynamo": dynamo, "eager": None}
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    prompt = "Write a long story about a lighthouse keeper."
    times: dict[str, list[float]] = {name: [] for name in variants}
    tokens = {}
    for _ in range(rounds):
        for name, step in variants.items():
            runner.compiled = step
            start = time.perf_counter()
            tokens[name] = llm.generate([prompt], params)[0].outputs[0].token_ids
            times[name].append(time.perf_counter() - start)
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name}: {TOKENS} tokens in {median:.3f} s median ({TOKENS / median:.1f} tok/s); "
              f"rounds {[round(v, 3) for v in values]}")
    print("same tokens:", tokens["loaded graphs"] == tokens["dynamo"] == tokens["eager"])


if __name__ == "__main__":
    main()
