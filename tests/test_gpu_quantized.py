"""Every quantization method and torch.compile on CUDA (GPU-marked; skipped without a GPU).

The CPU tests check each method against an independent dequantization and transformers. Here the
same checkpoints run on CUDA: each quantized linear against x @ W_deq^T in float64 on the CPU, and
greedy tokens on CUDA against fw's own CPU run of the same checkpoint (which the CPU tests tie to
transformers), logprobs within 1e-3. The models are fp32, so the GPU's products must stay IEEE fp32
(no TF32) for the tokens to agree."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from gguf import GGMLQuantizationType as T

import gguf_models
import quant_checkpoints as qc
import test_quant_awq as awq_case
import test_quant_gptq as gptq_case
from conftest import make_llm
from fw import SamplingParams
from fw.layers.linear import Linear

pytestmark = pytest.mark.gpu

PROMPTS = ["Hello world", "The engine schedules every request in pages.", "Once upon a time, in a small village"]
NEW_TOKENS = 12


def _greedy(llm) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    out = []
    for o in llm.generate(PROMPTS, params):
        c = o.outputs[0]
        out.append((c.token_ids, [entry[t].logprob for entry, t in zip(c.logprobs, c.token_ids)]))
    return out


def _same_as_cpu(path, **options) -> None:
    """Greedy tokens on CUDA equal the CPU run's; logprobs within 1e-3."""
    cuda = make_llm(path, device="cuda", **options)
    assert next(cuda.engine.loaded.model.parameters()).device.type == "cuda"
    got = _greedy(cuda)
    want = _greedy(make_llm(path, attention_backend="sdpa", **options))  # sdpa: no C++ build on the GPU machine
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, want):
        assert tokens == ref_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)) < 1e-3


@pytest.fixture(scope="module")
def float_model(tokenizer):
    return qc.float_llama(tokenizer, seed=3)


def test_gptq_on_cuda(float_model, tokenizer, tmp_path):
    tensors, weights = gptq_case.gptq_tensors(float_model, 4, 32, True, False, "gptq", seed=5)
    qcfg = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False}
    path = qc.save_checkpoint(tmp_path / "gptq", float_model, tokenizer, tensors, qcfg)
    from fw.quantizers.gptq import GPTQLinearMethod

    llm = make_llm(path, device="cuda")
    assert qc.check_linear_outputs(llm, weights, GPTQLinearMethod, device="cuda") == 8
    _same_as_cpu(path)


def test_awq_on_cuda(float_model, tokenizer, tmp_path):
    tensors, weights = awq_case.awq_tensors(float_model, 32)
    qcfg = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
    path = qc.save_checkpoint(tmp_path / "awq", float_model, tokenizer, tensors, qcfg)
    from fw.quantizers.awq import AWQLinearMethod

    llm = make_llm(path, device="cuda")
    assert qc.check_linear_outputs(llm, weights, AWQLinearMethod, device="cuda") == 8
    _same_as_cpu(path)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_gguf_kept_packed_on_cuda(qtype, tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    case = gguf_models.write_tiny_llama_gguf(tmp_path / f"{qtype.name}.gguf", qtype, tokenizer)
    options = {"tokenizer": str(tmp_path / "tokenizer"), "gguf_dequantize_at_load": False}
    llm = make_llm(case.path, device="cuda", **options)
    torch.manual_seed(0)
    for prefix, layer in llm.engine.loaded.model.named_modules():
        if not isinstance(layer, Linear):
            continue
        assert layer.weight.dtype == torch.uint8 and layer.weight.is_cuda, prefix
        head, _, leaf = prefix.rpartition(".")
        parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}.get(leaf, (leaf,))
        w = torch.cat([case.reference[f"{head}.{p}.weight" if head else f"{p}.weight"] for p in parts]).double()
        x = torch.randn(5, layer.input_size)
        torch.testing.assert_close(layer(x.cuda()).cpu().double(), x.double() @ w.T, rtol=1e-4, atol=1e-4)
    _same_as_cpu(case.path, **options)


def test_fp8_on_the_fly_on_cuda(gqa_dir):
    """fp32 activations take the weight-only path on CUDA too, so the tokens equal the CPU's."""
    _same_as_cpu(gqa_dir, quantization="fp8")


def test_fp8_bf16_on_cuda_uses_scaled_mm_and_answers(gqa_dir, monkeypatch):
    from fw.quantizers import fp8

    calls = []
    original = fp8._fp8_matmul
    monkeypatch.setattr(fp8, "_fp8_matmul", lambda *a: calls.append(a[0].shape) or original(*a))
    from fw import LLM

    llm = LLM(model=str(gqa_dir), device="cuda", quantization="fp8", dtype="bfloat16", num_kv_blocks=256)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == NEW_TOKENS for o in outs)
    if torch.cuda.get_device_capability() >= (9, 0):
        assert calls, "sm90+: bf16 fp8 linears should run on _scaled_mm"


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes is not installed")
@pytest.mark.parametrize("method", ["bitsandbytes-8bit", "bitsandbytes-nf4"])
def test_bitsandbytes_on_cuda(method, gqa_dir):
    """The library's CUDA kernels (8-bit: int8 matmul with outliers, so tokens are compared loosely)."""
    cuda = make_llm(gqa_dir, device="cuda", quantization=method)
    got = _greedy(cuda)
    want = _greedy(make_llm(gqa_dir, quantization=method, attention_backend="sdpa"))
    if method.endswith("nf4"):  # the same dequantized weights on both devices
        assert [t for t, _ in got] == [t for t, _ in want]
    else:
        same = sum(a == b for (x, _), (y, _) in zip(got, want) for a, b in zip(x, y))
        assert same >= 0.8 * len(PROMPTS) * NEW_TOKENS


def test_compiled_on_cuda_is_token_identical_to_eager(gqa_dir, tmp_path):
    small = dict(max_batch_size=4, max_batch_input_tokens=32, bucket_tokens_min=4)
    compiled = make_llm(gqa_dir, device="cuda", enable_torch_compile=True, compile_cache_dir=str(tmp_path), **small)
    eager = make_llm(gqa_dir, device="cuda", **small)
    got, want = _greedy(compiled), _greedy(eager)
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, want):
        assert tokens == ref_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)) < 1e-4
