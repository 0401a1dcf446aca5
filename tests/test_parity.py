"""fw against transformers on the same fp32 weights: identical greedy tokens,
per-token logprobs within 1e-3, and prompt logprobs, with every prompt of a
set submitted in one `generate` call so they share batches, under several
KV-cache page sizes and prefill chunkings."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from conftest import make_llm, record_steps
from fw import SamplingParams

PROMPTS = [
    "a",
    "Hello world",
    "The engine schedules every request in pages of keys and values.",
    "汉字测试：你好，世界！ 🙂",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Once upon a time, in a small village by the river, there lived an old clockmaker. He built a clock "
    "so quiet that the whole city forgot what time it was, and every morning the children ran to his window.",
]
NEW_TOKENS = 32
TOL = 1e-3

# Engine layouts that must not change the numbers: default pages, small pages (many page
# boundaries), and chunked prefill under a tight step budget (prompts split across steps and
# mixed with other sequences' decodes).
LAYOUTS = {
    "page16": {},
    "page4": {"kv_cache_page_size": 4},
    "chunked": {"kv_cache_page_size": 4, "prefill_chunk_size": 5, "max_batch_input_tokens": 12},
}


def hf_greedy(hf, ids: list[int], new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy continuation (never stopping at EOS) and the log-softmax of each step's logits."""
    config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0,
                              output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), generation_config=config, attention_mask=torch.ones(1, len(ids)))
    tokens = out.sequences[0, len(ids):].tolist()
    assert len(tokens) == new_tokens, "transformers stopped early; the reference must run the full length"
    return tokens, [torch.log_softmax(step[0].float(), dim=-1) for step in out.logits]


@pytest.fixture(scope="module")
def references(model_dirs, hf_model, tokenizer):
    """model name -> [(prompt ids, greedy tokens, per-step logprobs)] from transformers."""
    refs = {}
    for name, path in model_dirs.items():
        hf = hf_model(path)
        refs[name] = []
        for prompt in PROMPTS:
            ids = tokenizer(prompt).input_ids
            tokens, logprobs = hf_greedy(hf, ids, NEW_TOKENS)
            refs[name].append((ids, tokens, logprobs))
    return refs


# `auto` picks the fastest usable backend (cpu_paged on CPU); `sdpa` is the reference every backend
# is held to, so both stay checked against transformers.
@pytest.mark.parametrize("backend", ["auto", "sdpa"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("model", ["gqa", "mha"])
def test_greedy_tokens_and_logprobs_match_transformers(model, layout, backend, model_dirs, references):
    llm = make_llm(model_dirs[model], attention_backend=backend, **LAYOUTS[layout])
    assert backend == "auto" or llm.engine.loaded.attention.chosen.name == backend
    steps = record_steps(llm)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    outputs = llm.generate(PROMPTS, params)

    # All prompts really shared steps, and the layout did what it says.
    assert max(len(s) for s in steps) == len(PROMPTS)
    chunk = LAYOUTS[layout].get("prefill_chunk_size")
    if chunk:
        assert max(max(s) for s in steps) <= chunk
        assert any(1 in s and max(s) > 1 for s in steps), "no step mixed decodes with prefill chunks"

    for out, (ids, ref_tokens, ref_logprobs) in zip(outputs, references[model]):
        assert out.prompt_token_ids == ids
        got = out.outputs[0]
        assert got.token_ids == ref_tokens, f"prompt {out.prompt!r}"
        assert got.finish_reason == "length"
        assert len(got.logprobs) == NEW_TOKENS
        for pos, (entry, ref) in enumerate(zip(got.logprobs, ref_logprobs)):
            token = got.token_ids[pos]
            assert entry[token].rank == 1
            top_values, top_ids = torch.topk(ref, 2)
            assert set(entry) == set(top_ids.tolist())
            for tid in entry:
                assert abs(entry[tid].logprob - ref[tid].item()) < TOL, (pos, tid)
        chosen = [entry[token].logprob for entry, token in zip(got.logprobs, got.token_ids)]
        assert got.cumulative_logprob == pytest.approx(sum(chosen))


@pytest.mark.parametrize("layout", ["page16", "chunked"])
@pytest.mark.parametrize("model", ["gqa", "mha"])
def test_prompt_logprobs_match_transformers_forward(model, layout, model_dirs, hf_model, tokenizer):
    llm = make_llm(model_dirs[model], **LAYOUTS[layout])
    hf = hf_model(model_dirs[model])
    top = 3
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=top))
    for out in outputs:
        ids = out.prompt_token_ids
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
        plp = out.prompt_logprobs
        assert len(plp) == len(ids)
        assert plp[0] is None
        for j in range(1, len(ids)):
            entry, row = plp[j], ref[j - 1]
            assert ids[j] in entry
            assert abs(entry[ids[j]].logprob - row[ids[j]].item()) < TOL
            assert entry[ids[j]].rank == int((row > row[ids[j]]).sum()) + 1
            assert set(torch.topk(row, top).indices.tolist()) <= set(entry)
            for tid, lp in entry.items():
                assert abs(lp.logprob - row[tid].item()) < TOL
                assert lp.decoded_token == tokenizer.decode([tid])


def test_prompt_only_request_returns_prompt_logprobs_and_no_tokens(model_dirs, hf_model):
    llm = make_llm(model_dirs["mha"], **LAYOUTS["chunked"])
    out = llm.generate(PROMPTS[2], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
    ids = out.prompt_token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(model_dirs["mha"])(torch.tensor([ids])).logits[0].float(), dim=-1)
    assert len(out.prompt_logprobs) == len(ids)
    for j in range(1, len(ids)):
        assert list(out.prompt_logprobs[j]) == [ids[j]]
        assert abs(out.prompt_logprobs[j][ids[j]].logprob - ref[j - 1, ids[j]].item()) < TOL
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_prompts_as_token_ids_and_dicts_match_strings(llm, tokenizer):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ids = tokenizer(PROMPTS[2]).input_ids
    by_text, by_ids, by_dict = llm.generate([PROMPTS[2], ids, {"prompt_token_ids": ids}], params)
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids == by_dict.outputs[0].token_ids


@pytest.mark.gpu
def test_greedy_parity_on_cuda(model_dirs, references):
    from fw import LLM

    llm = LLM(model=str(model_dirs["gqa"]), dtype="float32", device="cuda", num_kv_blocks=256)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True,
                                                   logprobs=0))
    for out, (_, ref_tokens, ref_logprobs) in zip(outputs, references["gqa"]):
        assert out.outputs[0].token_ids == ref_tokens
        for entry, token, ref in zip(out.outputs[0].logprobs, ref_tokens, ref_logprobs):
            assert abs(entry[token].logprob - ref[token].item()) < TOL
