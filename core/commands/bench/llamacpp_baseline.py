"""The llama.cpp baseline of `fw bench latency` / `fw bench throughput`: llama.cpp's own benchmark binaries
on the same GGUF file with fw's thread count (`--llama-cpp-bin DIR`, the folder holding `llama-bench` and
`llama-batched-bench`, or found on PATH; docs/bench.md says how to build them from the `llama-cpp-python`
sdist). Without either, `fw.commands.bench.llamacpp_python` runs llama.cpp through its Python bindings.

* latency: `llama-bench -p IN -n 0` times the prefill (TTFT = IN / its tokens per second), then
  `llama-bench -p 0 -n OUT -d IN` the decode of OUT tokens after IN tokens of context, as fw's request does.
* throughput: `llama-batched-bench -npp IN -ntg OUT -npl N`: N sequences of IN prompt tokens each, decoded
  together (llama.cpp's continuous batching over one shared KV cache); its total time is the pass's.

llama.cpp makes its own prompt tokens, so prompt contents differ from fw's; lengths agree (the throughput
workload's mean length for every sequence, since llama-batched-bench takes one). One repetition per call,
so that fw and llama.cpp can take turns.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any, Sequence

from fw.commands.bench import BenchError

NAME = "llama.cpp"
BINARIES = ("llama-bench", "llama-batched-bench")


class LlamaCppBaseline:
    name = NAME

    def __init__(self, bin_dir: str | Path, model: Path, threads: int):
        self.bin_dir = Path(bin_dir)
        missing = [b for b in BINARIES if not (self.bin_dir / b).is_file()]
        if missing:
            raise BenchError(f"--llama-cpp-bin {self.bin_dir}: no {', '.join(missing)} there; build them with "
                             f"`ninja -C build {' '.join(BINARIES)}` in llama.cpp (docs/bench.md)")
        if model.suffix != ".gguf":
            raise BenchError(f"--baseline llama.cpp runs GGUF files; the model is {model}")
        self.model = model
        self.threads = threads

    def _run(self, binary: str, *args: str) -> str:
        command = [str(self.bin_dir / binary), "-m", str(self.model), "-t", str(self.threads), *args]
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=3600)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise BenchError(f"{binary} did not run: {exc}") from None
        if proc.returncode != 0:
            tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
            raise BenchError(f"{binary} failed (exit {proc.returncode}): {' '.join(command)}\n{tail}")
        return proc.stdout

    def _tokens_per_second(self, *args: str) -> float:
        rows = json.loads(self._run("llama-bench", "-r", "1", "-o", "json", *args))
        if len(rows) != 1:
            raise BenchError(f"llama-bench reported {len(rows)} tests for one: {rows}")
        return float(rows[0]["avg_ts"])

    def latency_iteration(self, prompt: Sequence[int], output_len: int) -> dict[str, Any]:
        n = len(prompt)
        ttft = n / self._tokens_per_second("-p", str(n), "-n", "0")
        decode = self._tokens_per_second("-p", "0", "-n", str(output_len), "-d", str(n))
        return {"ttft_s": ttft, "e2e_s": ttft + output_len / decode, "output_tokens": output_len,
                "decode_tok_s": decode}

    def throughput(self, prompts: Sequence[Sequence[int]], output_len: int, batch_size: int,
                   progress=None) -> dict[str, float]:
        count = len(prompts)
        input_len = max(1, round(sum(len(p) for p in prompts) / count))
        context = count * (input_len + output_len)
        out = self._run("llama-batched-bench", "-c", str(context), "-b", "2048", "-ub", "512",
                        "-npp", str(input_len), "-ntg", str(output_len), "-npl", str(count),
                        "--output-format", "jsonl")
        rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        if len(rows) != 1 or "t" not in rows[0]:
            raise BenchError(f"llama-batched-bench printed no result line: {out[-500:]}")
        if progress is not None:
            progress.update(count)
        return {"elapsed_s": float(rows[0]["t"]), "output_tokens": count * output_len}

    def describe(self) -> dict[str, Any]:
        proc = subprocess.run([str(self.bin_dir / "llama-bench"), "--version"], capture_output=True, text=True)
        version = (proc.stdout + proc.stderr).strip().splitlines()
        return {"name": NAME, "via": "llama-bench / llama-batched-bench (llama.cpp's own binaries)",
                "bin_dir": str(self.bin_dir), "version": version[0] if version else None, "threads": self.threads,
                "model": str(self.model)}


def find_binaries() -> Path | None:
    """llama-bench's folder when it is on PATH (a convenience default for --llama-cpp-bin)."""
    found = shutil.which("llama-bench")
    return Path(found).parent if found else None
