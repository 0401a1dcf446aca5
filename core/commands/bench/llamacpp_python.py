"""The llama.cpp baseline through the `llama-cpp-python` bindings, for `--baseline llama.cpp` without
`--llama-cpp-bin` (`pip install 'fw[llamacpp]'` builds llama.cpp from source).

It drives llama.cpp's C API as llama-batched-bench does: each prompt prefilled on its own sequence (fw's own
token ids: the same GGUF vocabulary), then every sequence decoded together, one token per sequence a
`llama_decode`, greedy. Latency is the same with one sequence. Python fills each step's batch and reads the
logits, so a token costs a little more than in llama.cpp's own binaries; the report says which route ran.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from fw.commands.bench import BenchError

NAME = "llama.cpp"
PREFILL_CHUNK = 512  # tokens per llama_decode of a prompt (llama-batched-bench's -b / -ub)


def _bindings() -> Any:
    try:
        import llama_cpp  # here: an optional extra (fw[llamacpp]); its absence is a clear error below
    except ImportError:
        raise BenchError("--baseline llama.cpp needs llama.cpp: either --llama-cpp-bin DIR (the folder with its "
                         "llama-bench and llama-batched-bench; docs/bench.md says how to build them) or the "
                         "llama-cpp-python bindings: pip install 'fw[llamacpp]' (builds llama.cpp from source)"
                         ) from None
    return llama_cpp


class LlamaCppPythonBaseline:
    name = NAME

    def __init__(self, model: Path, threads: int):
        if model.suffix != ".gguf":
            raise BenchError(f"--baseline llama.cpp runs GGUF files; the model is {model}")
        self.lib = _bindings()
        self.model_path = model
        self.threads = threads
        self.lib.llama_backend_init()
        params = self.lib.llama_model_default_params()
        self.model = self.lib.llama_model_load_from_file(str(model).encode(), params)
        if not self.model:
            raise BenchError(f"llama-cpp-python could not load {model}")
        self.n_vocab = self.lib.llama_vocab_n_tokens(self.lib.llama_model_get_vocab(self.model))
        self._contexts: dict[tuple[int, int], Any] = {}

    def _context(self, n_ctx: int, n_seq: int) -> Any:
        """A context for `n_seq` sequences sharing `n_ctx` cells, made once per shape (outside the timings)."""
        key = (n_ctx, n_seq)
        if key not in self._contexts:
            params = self.lib.llama_context_default_params()
            params.n_ctx = n_ctx
            params.n_batch = max(PREFILL_CHUNK, n_seq)
            params.n_ubatch = max(PREFILL_CHUNK, n_seq)
            params.n_seq_max = n_seq
            params.n_threads = params.n_threads_batch = self.threads
            params.no_perf = True
            ctx = self.lib.llama_init_from_model(self.model, params)
            if not ctx:
                raise BenchError(f"llama-cpp-python could not make a context of {n_ctx} tokens x {n_seq} sequences")
            self._contexts[key] = ctx
        return self._contexts[key]

    def _greedy(self, ctx: Any, rows: int) -> list[int]:
        """The argmax of the last decode's `rows` output rows."""
        logits = np.ctypeslib.as_array(self.lib.llama_get_logits(ctx), shape=(rows * self.n_vocab,))
        return logits.reshape(rows, self.n_vocab).argmax(axis=1).tolist()

    def _decode(self, ctx: Any, batch: Any, entries: Sequence[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) entries."""
        batch.n_tokens = len(entries)
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = logits
        status = self.lib.llama_decode(ctx, batch)
        if status != 0:
            raise BenchError(f"llama_decode failed ({status})")

    def generate(self, prompts: Sequence[Sequence[int]], output_len: int) -> dict[str, float]:
        """Greedy `output_len` tokens for every prompt: the first after its prefill, then all decoded together.
        Returns the tokens, when the first one came (after the first prompt's prefill) and when the last did."""
        n = len(prompts)
        ctx = self._context(sum(len(p) for p in prompts) + n * output_len + 16, n)
        self.lib.llama_memory_clear(self.lib.llama_get_memory(ctx), True)
        batch = self.lib.llama_batch_init(max(PREFILL_CHUNK, n), 0, 1)
        try:
            start = time.perf_counter()
            last, first_token_at, tokens = [], None, []
            for seq, prompt in enumerate(prompts):
                for c0 in range(0, len(prompt), PREFILL_CHUNK):
                    chunk = prompt[c0:c0 + PREFILL_CHUNK]
                    end = c0 + len(chunk) == len(prompt)
                    self._decode(ctx, batch, [(t, c0 + i, seq, end and i == len(chunk) - 1)
                                              for i, t in enumerate(chunk)])
                last.append(self._greedy(ctx, 1)[0])
                tokens.append([last[-1]])
                first_token_at = first_token_at or time.perf_counter()
            for step in range(1, output_len):
                self._decode(ctx, batch, [(last[s], len(prompts[s]) + step - 1, s, True) for s in range(n)])
                last = self._greedy(ctx, n)
                for seq, token in zip(tokens, last):
                    seq.append(token)
            end = time.perf_counter()
        finally:
            self.lib.llama_batch_free(batch)
        return {"tokens": tokens, "start": start, "first": first_token_at, "end": end}

    def latency_iteration(self, prompt: Sequence[int], output_len: int) -> dict[str, Any]:
        t = self.generate([prompt], output_len)
        span = t["end"] - t["first"]
        return {"ttft_s": t["first"] - t["start"], "e2e_s": t["end"] - t["start"], "output_tokens": output_len,
                "decode_tok_s": (output_len - 1) / span if output_len > 1 and span > 0 else None}

    def throughput(self, prompts: Sequence[Sequence[int]], output_len: int, batch_size: int,
                   progress=None) -> dict[str, float]:
        t = self.generate(prompts, output_len)
        if progress is not None:
            progress.update(len(prompts))
        return {"elapsed_s": t["end"] - t["start"], "output_tokens": len(prompts) * output_len}

    def describe(self) -> dict[str, Any]:
        version = getattr(self.lib, "__version__", None)
        return {"name": NAME, "via": "llama-cpp-python (Python bindings over llama.cpp's C API: Python fills each "
                                     "step's batch and reads its logits, which llama.cpp's own binaries do not)",
                "version": version, "threads": self.threads, "model": str(self.model_path)}

    def close(self) -> None:
        for ctx in self._contexts.values():
            self.lib.llama_free(ctx)
        self._contexts.clear()
        if self.model:
            self.lib.llama_model_free(self.model)
            self.model = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the bindings may be gone already
            pass
