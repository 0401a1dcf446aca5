"""The transformers baseline of `fw bench latency` / `fw bench throughput`.

The same weights as fw's engine (the directory, or the .gguf file dequantized
by transformers), the same dtype and device, the same prompt token ids, greedy
decoding of exactly `output_len` tokens (`min_new_tokens = max_new_tokens`, so
EOS cannot end a sequence early). Every call passes an explicit attention mask:
SmolLM2's pad id is its EOS id, and without a mask transformers would guess one
from the pad id and mask real prompt tokens.
"""

from __future__ import annotations

import time
from typing import Any, Iterable, Sequence

import torch
from transformers import AutoModelForCausalLM

from fw.commands.bench import BenchError

try:
    from transformers import GgufConfig
except ImportError:  # older transformers: no such option, they always dequantize
    GgufConfig = None

NAME = "transformers"


def load_model(source: Any, dtype: torch.dtype, device: torch.device):
    """transformers' AutoModelForCausalLM on fw's resolved ModelSource (kind "directory" or "gguf")."""
    if source.kind == "gguf":
        # Dense weights, as fw has them: transformers' packed-GGUF path (its own matmul kernels) would
        # measure something else. Older versions always dequantize and have no such option.
        extra = {"quantization_config": GgufConfig(dequantize=True)} if GgufConfig is not None else {}
        model = AutoModelForCausalLM.from_pretrained(str(source.path.parent), gguf_file=source.path.name,
                                                     dtype=dtype, **extra)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(source.path), dtype=dtype)
    return model.to(device).eval()


def pad_token_id(model, tokenizer) -> int:
    """The tokenizer's pad id, else its EOS id (the usual choice; masked out either way), else 0."""
    for value in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None),
                  model.generation_config.pad_token_id, model.generation_config.eos_token_id):
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask for a batch, padded on the left (tokenizer.padding_side="left" does the same
    for text): generation appends on the right, so every row's last prompt token sits in the last column."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if prompt:
            ids[row, width - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
            mask[row, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)


def generate(model, prompts: Sequence[Sequence[int]], new_tokens: int, pad_id: int) -> int:
    """Greedy generation of exactly `new_tokens` per prompt; returns the number of tokens generated in all."""
    ids, mask = left_pad(prompts, pad_id, model.device)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id,
                             temperature=None, top_p=None, top_k=None)
    generated = (out.shape[1] - ids.shape[1]) * out.shape[0]
    if out.shape[1] - ids.shape[1] != new_tokens:
        raise BenchError(f"transformers generated {out.shape[1] - ids.shape[1]} tokens, not {new_tokens}")
    return generated


def latency_iteration(model, prompt: Sequence[int], output_len: int, pad_id: int) -> dict[str, float]:
    """One request: TTFT is a 1-token generate (prefill + first token), the full run is a generate of
    `output_len` tokens; decode tok/s is (output_len - 1) over their difference."""
    t0 = time.perf_counter()
    generate(model, [prompt], 1, pad_id)
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    n = generate(model, [prompt], output_len, pad_id)
    e2e = time.perf_counter() - t0
    decode = e2e - ttft
    return {"ttft_s": ttft, "e2e_s": e2e, "output_tokens": n,
            "decode_tok_s": (n - 1) / decode if n > 1 and decode > 0 else None}


def throughput(model, prompts: Sequence[Sequence[int]], output_len: int, batch_size: int, pad_id: int,
               progress: Iterable | None = None) -> dict[str, float]:
    """Static batches of `batch_size` prompts in the given order, left-padded, like vLLM's
    `benchmark_throughput --backend hf`; returns elapsed seconds and generated tokens."""
    t0 = time.perf_counter()
    generated = 0
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start:start + batch_size]
        generated += generate(model, batch, output_len, pad_id)
        if progress is not None:
            progress.update(len(batch))
    return {"elapsed_s": time.perf_counter() - t0, "output_tokens": generated}


def describe(model) -> dict[str, Any]:
    """What the JSON report says about the baseline's setup."""
    return {"name": NAME, "class": type(model).__name__, "dtype": str(model.dtype).removeprefix("torch."),
            "attn_implementation": getattr(model.config, "_attn_implementation", None)}
