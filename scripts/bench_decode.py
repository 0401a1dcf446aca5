"""Decode speed of fw on SmolLM2-135M-Instruct (the bundled GGUF): one request,
and many concurrent requests. A stopgap until `fw bench`; prints JSON.

    python scripts/bench_decode.py [--dtype float32] [--tokens 128] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import json
import time

from fw import LLM, SamplingParams
from fw.default_model import default_model

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def single(llm: LLM, tokens: int) -> dict:
    """Batch 1: decode tok/s between the first and the last token (prefill excluded)."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    stamps = []
    for out in llm.stream(PROMPT, params):
        stamps.extend([time.perf_counter()] * len(out.outputs[0].token_ids))
    return {
        "ttft_s": round(stamps[0] - start, 4),
        "decode_tok_s": round((len(stamps) - 1) / (stamps[-1] - stamps[0]), 1),
        "tokens": len(stamps),
    }


def concurrent(llm: LLM, tokens: int, n: int) -> dict:
    """n requests at once: output tok/s over the whole run, and during pure decode steps."""
    engine = llm.engine
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    for i in range(n):
        engine.add_request(prompt=f"{PROMPT} Variant {i}.", params=params)
    start = time.perf_counter()
    produced = decode_tokens = 0
    decode_time = 0.0
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        step_tokens = len(outs)
        produced += step_tokens
        if all(s.num_output_tokens > 1 for s in engine.scheduler.running) and step_tokens == len(outs):
            decode_tokens += step_tokens
            decode_time += dt
    total = time.perf_counter() - start
    return {
        "requests": n,
        "output_tokens": produced,
        "total_s": round(total, 2),
        "output_tok_s": round(produced / total, 1),
        "decode_tok_s": round(decode_tokens / decode_time, 1) if decode_time else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=32)
    args = ap.parse_args()
    llm = LLM(args.model or default_model(), dtype=args.dtype, max_batch_size=max(64, args.concurrency))
    llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0))  # warm-up
    report = {"model": args.model or "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)", "dtype": args.dtype,
              "batch_1": single(llm, args.tokens), f"concurrent_{args.concurrency}": concurrent(llm, args.tokens,
                                                                                               args.concurrency)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
