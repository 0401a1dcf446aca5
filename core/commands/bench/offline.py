"""`fw bench latency` and `fw bench throughput`: offline, in-process benchmarks of fw's `LLM`, with the
same workload optionally run on a transformers baseline (fw.commands.bench.hf_baseline) in the same process.

Prompts are synthetic (fw.commands.bench.prompts' word list), tokenized with the model's tokenizer and cut or
extended to exactly the requested number of token ids; both fw and the baseline get the same ids.
Every request generates exactly `output_len` tokens (greedy, EOS ignored on fw's side, min_new_tokens
on the baseline's). Ratios are fw / baseline for every figure: above 1 is better for fw on a rate
(tok/s, req/s), worse on a time (TTFT, latency).
"""

from __future__ import annotations

import platform
import random
import statistics
import sys
import time
from typing import Any, Sequence

import torch
from tqdm import tqdm

from fw.commands.bench import BenchError, machine_speed
from fw.commands.bench.llamacpp_baseline import LlamaCppBaseline, find_binaries
from fw.commands.bench.llamacpp_python import LlamaCppPythonBaseline
from fw.commands.bench.prompts import make_prompt, sample_lengths
from fw.commands.bench.report import summarize
from fw.sampling.params import SamplingParams
from fw.version import __version__

# --- prompts ---------------------------------------------------------------------------------------------------


def exact_length_ids(tokenizer, length: int, rng: random.Random) -> list[int]:
    """Token ids of a synthetic prompt, exactly `length` long: words from the list, tokenized without
    special tokens, extended until long enough, then truncated."""
    if length < 1:
        raise BenchError(f"prompt length must be at least 1, got {length}")
    ids: list[int] = []
    while len(ids) < length:
        text = make_prompt(length - len(ids), rng)  # a word is at least one token, so one round mostly does
        more = tokenizer.encode((" " if ids else "") + text, add_special_tokens=False)
        if not more:
            raise BenchError("the tokenizer turns the prompt words into no tokens")
        ids.extend(more)
    return ids[:length]


# --workload: random words (the default), or `copy`: prompts a model continues by repeating a passage, the
# workload speculative decoding's n-gram proposer is for (docs/speculative.md).
WORKLOADS = ("random", "copy")


def copy_ids(tokenizer, length: int, rng: random.Random) -> list[int]:
    """A passage of random words about a third of `length`, written out again and again, cut at exactly
    `length` tokens (mid-passage): the continuation repeats the passage."""
    passage = exact_length_ids(tokenizer, max(1, min(length, max(16, length // 3))), rng)
    return (passage * (length // len(passage) + 1))[:length]


def make_prompts(tokenizer, lengths: Sequence[int], seed: int, workload: str = "random") -> list[list[int]]:
    if workload not in WORKLOADS:
        raise BenchError(f"--workload must be one of {', '.join(WORKLOADS)}; got {workload!r}")
    rng = random.Random(seed)
    make = copy_ids if workload == "copy" else exact_length_ids
    return [make(tokenizer, n, rng) for n in lengths]


SPEC_COUNTERS = ("spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens")


def speculation(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any] | None:
    """What speculative decoding did between two `LLMEngine.stats()`: drafts, draft and accepted tokens,
    the acceptance rate and the mean acceptance length (tokens per verify pass); None without it."""
    if "spec_num_drafts" not in after:
        return None
    d = {key[5:]: after[key] - before.get(key, 0) for key in SPEC_COUNTERS}
    d["acceptance_rate"] = d["num_accepted_tokens"] / d["num_draft_tokens"] if d["num_draft_tokens"] else 0.0
    d["mean_acceptance_length"] = 1 + d["num_accepted_tokens"] / d["num_drafts"] if d["num_drafts"] else 0.0
    return d


def throughput_lengths(input_len: int, input_len_range: float, num_prompts: int, seed: int) -> list[int]:
    """Prompt lengths uniform over [len*(1-r), len*(1+r)], as `fw bench serve` and vLLM's random dataset."""
    try:
        return sample_lengths(input_len, input_len_range, num_prompts, random.Random(seed))
    except ValueError as exc:
        raise BenchError(str(exc)) from None


# --- fw --------------------------------------------------------------------------------------------------------


def fw_params(output_len: int, speculative: bool = True):
    return SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True, speculative=speculative)


def fw_latency_iteration(llm, prompt: list[int], output_len: int, speculative: bool = True) -> dict[str, Any]:
    """One streamed request: TTFT = first token's arrival - start; decode tok/s = (n-1) / (last - first)."""
    params = fw_params(output_len, speculative)
    stamps: list[float] = []
    start = time.perf_counter()
    for out in llm.stream(prompt, params):
        now = time.perf_counter()
        stamps.extend([now] * len(out.outputs[0].token_ids))
    end = time.perf_counter()
    if not stamps:
        raise BenchError("fw generated no tokens")
    span = stamps[-1] - stamps[0]
    return {"ttft_s": stamps[0] - start, "e2e_s": end - start, "output_tokens": len(stamps),
            "decode_tok_s": (len(stamps) - 1) / span if len(stamps) > 1 and span > 0 else None}


def fw_throughput(llm, prompts: list[list[int]], output_len: int, speculative: bool = True) -> dict[str, float]:
    """All prompts to `LLM.generate` at once (continuous batching does the rest)."""
    start = time.perf_counter()
    outs = llm.generate(prompts, fw_params(output_len, speculative))
    elapsed = time.perf_counter() - start
    return {"elapsed_s": elapsed, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs)}


# --- runs ------------------------------------------------------------------------------------------------------


def progress_bar(total: int, desc: str, enabled: bool):
    return tqdm(total=total, desc=desc, disable=not enabled, file=sys.stderr, leave=False)


def latency_summary(iterations: list[dict]) -> dict[str, Any]:
    """Medians over iterations (ms and tok/s), with the full statistics and the raw iterations."""
    ttft = [r["ttft_s"] * 1000 for r in iterations]
    e2e = [r["e2e_s"] * 1000 for r in iterations]
    decode = [r["decode_tok_s"] for r in iterations if r["decode_tok_s"] is not None]
    return {
        "ttft_ms": statistics.median(ttft),
        "decode_tok_s": statistics.median(decode) if decode else None,
        "e2e_ms": statistics.median(e2e),
        "output_tokens": iterations[0]["output_tokens"],
        "stats": {"ttft_ms": summarize(ttft), "decode_tok_s": summarize(decode), "e2e_ms": summarize(e2e)},
        "iterations": iterations,
    }


def throughput_summary(measured: dict[str, float], num_prompts: int, input_tokens: int) -> dict[str, Any]:
    elapsed = measured["elapsed_s"]
    out = measured["output_tokens"]
    return {"elapsed_s": elapsed, "num_prompts": num_prompts, "input_tokens": input_tokens, "output_tokens": out,
            "request_throughput": num_prompts / elapsed, "output_throughput": out / elapsed,
            "total_token_throughput": (input_tokens + out) / elapsed}


LATENCY_METRICS = (("ttft_ms", "TTFT (ms, median)"), ("decode_tok_s", "Decode (tok/s, median)"),
                   ("e2e_ms", "E2E latency (ms, median)"))
THROUGHPUT_METRICS = (("output_throughput", "Output (tok/s)"), ("total_token_throughput", "Total (tok/s)"),
                      ("request_throughput", "Requests (req/s)"), ("elapsed_s", "Elapsed (s)"),
                      ("output_tokens", "Output tokens"))


def ratios(fw: dict, baseline: dict | None, keys: Sequence[str]) -> dict[str, float | None] | None:
    """fw / baseline for each key (None where either is missing or the baseline is 0)."""
    if baseline is None:
        return None
    return {k: fw[k] / baseline[k] if fw.get(k) is not None and baseline.get(k) else None for k in keys}


def environment(llm, machine_before: dict[str, float]) -> dict[str, Any]:
    """Versions, threads and device, and the machine's speed (fw.commands.bench.machine_speed) measured
    before the run (`machine_before`) and now, after it."""
    import transformers  # here: transformers costs 0.6 s of start-up; only its version is read, after the run

    loaded = llm.engine.loaded
    machine = {"device_name": machine_speed.device_name(loaded.device), "before": machine_before,
               "after": machine_now(llm)}
    return {"fw_version": __version__, "torch_version": torch.__version__,
            "transformers_version": transformers.__version__, "python_version": platform.python_version(),
            "num_threads": torch.get_num_threads(), "device": str(loaded.device),
            "platform": platform.platform(), "machine": machine}


def machine_now(llm) -> dict[str, float]:
    """The machine's speed now, in the loaded model's device and dtype."""
    return machine_speed.measure(llm.engine.loaded.device, llm.engine.loaded.dtype)


def model_info(llm) -> dict[str, Any]:
    loaded = llm.engine.loaded
    return {"model": loaded.source.name, "model_path": str(loaded.source.path), "model_kind": loaded.source.kind,
            "dtype": str(loaded.dtype).removeprefix("torch."), "attention_backend": loaded.attention.chosen.name}


class TransformersBaseline:
    """The transformers model on fw's weights, dtype and device, loaded once per run."""

    name = "transformers"

    def __init__(self, llm, progress: bool = True):
        from fw.commands.bench import hf_baseline  # here: transformers' models load only for this baseline

        if not progress:
            from transformers.utils import logging as hf_logging  # here: as above

            hf_logging.disable_progress_bar()  # its GGUF conversion bar

        loaded = llm.engine.loaded
        self.hf = hf_baseline
        self.model = hf_baseline.load_model(loaded.source, loaded.dtype, loaded.device)
        self.pad_id = hf_baseline.pad_token_id(self.model, llm.tokenizer)

    def latency_iteration(self, prompt: list[int], output_len: int) -> dict[str, Any]:
        return self.hf.latency_iteration(self.model, prompt, output_len, self.pad_id)

    def throughput(self, prompts: list[list[int]], output_len: int, batch_size: int, progress=None) -> dict:
        return self.hf.throughput(self.model, prompts, output_len, batch_size, self.pad_id, progress)

    def warm_up(self, prompts: list[list[int]], batch_size: int) -> None:
        self.throughput(prompts, 4, batch_size)

    def describe(self) -> dict[str, Any]:
        return self.hf.describe(self.model)


class NoSpeculationBaseline:
    """fw itself without speculative decoding: the same engine, every request opted out
    (`SamplingParams.speculative=False`), so the two sides share the model, the process and the machine's
    drift pass by pass (docs/speculative.md)."""

    name = "no-speculation"  # as the flag names it (and it fits the table's column)
    shares_engine = True  # its prompts must differ from fw's, or fw's prefix cache would serve its prefills

    def __init__(self, llm):
        if llm.engine.speculator is None:
            raise BenchError("--baseline no-speculation compares fw with and without speculative decoding; give "
                             "--speculative-config too")
        self.llm = llm

    def latency_iteration(self, prompt: list[int], output_len: int) -> dict[str, Any]:
        return fw_latency_iteration(self.llm, prompt, output_len, speculative=False)

    def throughput(self, prompts: list[list[int]], output_len: int, batch_size: int, progress=None) -> dict:
        return fw_throughput(self.llm, prompts, output_len, speculative=False)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "speculative_config": self.llm.engine.config.speculative_config}


BASELINES = ("none", "transformers", "llama.cpp", "no-speculation")


def make_baseline(kind: str, llm, llama_cpp_bin: str | None = None, progress: bool = True):
    """None, or the baseline `kind` names on fw's model (the same file, dtype, device and threads)."""
    if kind in (None, "none", False):
        return None
    if kind in ("transformers", True):
        return TransformersBaseline(llm, progress)
    if kind == "no-speculation":
        return NoSpeculationBaseline(llm)
    if kind == "llama.cpp":
        model, threads = llm.engine.loaded.source.path, torch.get_num_threads()
        binaries = llama_cpp_bin or find_binaries()
        if binaries is not None:
            return LlamaCppBaseline(binaries, model, threads)
        return LlamaCppPythonBaseline(model, threads)
    raise BenchError(f"--baseline must be one of {', '.join(BASELINES)}; got {kind!r}")


def warm_up(llm, baseline, prompts: list[list[int]], batch_size: int) -> None:
    """The workload's shapes, a few tokens long, through each: one-time costs (the allocator's first
    touch of memory, oneDNN's kernel choice per matrix shape) stay out of the figures. The prompts must
    differ from the measured ones, or fw's prefix cache would serve the measured prefills."""
    llm.generate(prompts, fw_params(4))
    if baseline is not None and hasattr(baseline, "warm_up"):
        baseline.warm_up(prompts, batch_size)


def bench_latency(llm, *, input_len: int, output_len: int, num_iters: int, num_iters_warmup: int,
                  baseline: str | None = "none", llama_cpp_bin: str | None = None, seed: int = 0,
                  progress: bool = True, workload: str = "random") -> dict[str, Any]:
    """One request at a time, `num_iters_warmup + num_iters` times, each with its own prompt (a repeated
    prompt would be served from fw's prefix cache), fw and the baseline taking turns iteration by
    iteration (the machine's speed drifts); medians over the measured iterations."""
    if num_iters < 1 or num_iters_warmup < 0 or output_len < 1:
        raise BenchError("--num-iters and --output-len must be at least 1, --num-iters-warmup at least 0")
    prompts = make_prompts(llm.tokenizer, [input_len] * (num_iters_warmup + num_iters), seed, workload)
    base = make_baseline(baseline, llm, llama_cpp_bin, progress)
    base_prompts = _baseline_prompts(base, llm, prompts, seed, workload)
    fw_runs, base_runs = [], []
    stats = None
    machine = machine_now(llm)
    with progress_bar(len(prompts), "fw" if base is None else f"fw and {base.name}", progress) as bar:
        for i, prompt in enumerate(prompts):
            if i == num_iters_warmup:
                stats = llm.engine.stats()
            fw_runs.append(fw_latency_iteration(llm, prompt, output_len))
            if base is not None:
                base_runs.append(base.latency_iteration(base_prompts[i], output_len))
            bar.update(1)
    fw = latency_summary(fw_runs[num_iters_warmup:])
    spec = speculation(stats, llm.engine.stats())
    if spec is not None:
        fw["speculative"] = spec
    base_summary = latency_summary(base_runs[num_iters_warmup:]) if base is not None else None
    keys = [k for k, _ in LATENCY_METRICS]
    return {"benchmark": "latency", **model_info(llm),
            "workload": {"kind": workload, "input_len": input_len, "output_len": output_len, "num_iters": num_iters,
                         "num_iters_warmup": num_iters_warmup, "seed": seed},
            "environment": environment(llm, machine), "fw": fw, "baseline": base_summary,
            "baseline_info": base.describe() if base is not None else None,
            "ratios": ratios(fw, base_summary, keys)}


def bench_throughput(llm, *, num_prompts: int, input_len: int, input_len_range: float, output_len: int,
                     baseline: str | None = "none", llama_cpp_bin: str | None = None, baseline_batch_size: int = 64,
                     seed: int = 0, num_passes: int = 1, progress: bool = True,
                     workload: str = "random") -> dict[str, Any]:
    """All prompts to fw at once; the transformers baseline in static batches of `baseline_batch_size`,
    llama.cpp's batched bench with all sequences at once. With several passes, fw and the baseline take
    turns (fw, baseline, fw, ...), each pass on new prompts of the same lengths (repeats would hit fw's
    prefix cache), so a machine whose speed drifts slows both alike; the figures are each side's median pass."""
    if num_prompts < 1 or output_len < 1 or baseline_batch_size < 1 or num_passes < 1:
        raise BenchError("--num-prompts, --output-len, --baseline-batch-size and --num-passes must be at least 1")
    lengths = throughput_lengths(input_len, input_len_range, num_prompts, seed)
    input_tokens = sum(lengths)
    base = make_baseline(baseline, llm, llama_cpp_bin, progress)
    warm_up(llm, base, make_prompts(llm.tokenizer, lengths, seed + 1, workload), baseline_batch_size)
    fw_passes: list[dict[str, Any]] = []
    base_passes: list[dict[str, Any]] = []
    stats = llm.engine.stats()
    machine = machine_now(llm)
    for i in range(num_passes):
        prompts = make_prompts(llm.tokenizer, lengths, seed if i == 0 else seed + 1 + i, workload)
        if progress:
            print(f"fw: {num_prompts} prompts x {output_len} tokens (pass {i + 1} of {num_passes}) ...",
                  file=sys.stderr)
        fw_passes.append(throughput_summary(fw_throughput(llm, prompts, output_len), num_prompts, input_tokens))
        if base is not None:
            with progress_bar(num_prompts, base.name, progress) as bar:
                measured = base.throughput(_baseline_prompts(base, llm, prompts, seed + 1 + i, workload), output_len,
                                           baseline_batch_size, bar)
            base_passes.append(throughput_summary(measured, num_prompts, input_tokens))
    fw, base_summary = median_pass(fw_passes), median_pass(base_passes) if base_passes else None
    spec = speculation(stats, llm.engine.stats())  # over all passes
    if spec is not None:
        fw = {**fw, "speculative": spec}
    keys = [k for k, _ in THROUGHPUT_METRICS]
    return {"benchmark": "throughput", **model_info(llm),
            "workload": {"kind": workload, "num_prompts": num_prompts, "input_len": input_len, "input_len_range": input_len_range,
                         "min_input_len": min(lengths), "max_input_len": max(lengths), "output_len": output_len,
                         "baseline_batch_size": baseline_batch_size, "seed": seed, "num_passes": num_passes},
            "environment": environment(llm, machine), "fw": fw, "baseline": base_summary,
            "baseline_info": base.describe() if base is not None else None, "ratios": ratios(fw, base_summary, keys),
            "passes": {"fw": fw_passes, "baseline": base_passes or None}}


def _baseline_prompts(base, llm, prompts: list[list[int]], seed: int, workload: str) -> list[list[int]]:
    """fw's prompts, or for a baseline on fw's own engine new ones of the same lengths (from a seed no
    pass of fw uses)."""
    if not getattr(base, "shares_engine", False):
        return prompts
    return make_prompts(llm.tokenizer, [len(p) for p in prompts], seed + 1_000_003, workload)


def median_pass(passes: list[dict[str, Any]]) -> dict[str, Any]:
    """The pass with the median elapsed time (the lower middle one of an even count)."""
    ordered = sorted(passes, key=lambda p: p["elapsed_s"])
    return ordered[(len(ordered) - 1) // 2]
