"""GPTQ and AWQ 4-bit checkpoints, and bitsandbytes 8-bit weights, on fw's packed-int CPU kernels
(fw.kernels.packed_int): the layers are repacked at load (`qweight` or `weight` holds the kernels' layout;
the other checkpoint tensors are dropped), each linear meets the int8-activation reference on the test's
own dequantized weights, and the text's likelihood stays close to the plain-torch path's. Act-order GPTQ
and groups that split a 32-input block keep the plain-torch path."""

from __future__ import annotations

import pytest
import torch

import quant_checkpoints as qc
import test_quant_awq as awq_case
import test_quant_gptq as gptq_case
from conftest import make_llm
from fw import SamplingParams
from fw.layers import Linear
from fw.kernels import packed_int

pytestmark = pytest.mark.skipif(not packed_int.ready(), reason="no AVX512-VNNI CPU or no C++ toolchain")

TEXT = " ".join(qc.PROMPTS * 3)


@pytest.fixture(scope="module")
def float_model(tokenizer):
    return qc.float_llama(tokenizer, seed=5)


def _check_layers(llm, weights: dict[str, torch.Tensor], repacked: bool) -> None:
    torch.manual_seed(0)
    for name, layer in llm.engine.loaded.model.named_modules():
        if not isinstance(layer, Linear) or name == "lm_head":
            continue
        assert (layer.packed_int is not None) == repacked, name
        if not repacked:
            continue
        assert {n for n, _ in layer.named_parameters()} == {"qweight"}, name  # the kernels' layout now
        x = torch.randn(6, layer.input_size)
        want = packed_int.quantize_activations(x, 4).double() @ qc.fused_reference(weights, name).double().T
        got = layer(x).double()
        # the kernels keep each offset -scale * zero in fp16: ~1e-4 of the output, not 1e-5
        assert (got - want).abs().max() <= 1e-3 * want.abs().max(), name


def _mean_nll(llm) -> float:
    out = llm.generate([TEXT], SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0))[0]
    ids = out.prompt_token_ids
    return -sum(d[i].logprob for d, i in zip(out.prompt_logprobs[1:], ids[1:])) / (len(ids) - 1)


def _close_to_reference_path(path, monkeypatch) -> None:
    kernel = _mean_nll(make_llm(path))
    monkeypatch.setenv("FW_CPU_PACKED_INT", "0")
    reference = _mean_nll(make_llm(path))
    monkeypatch.setenv("FW_CPU_PACKED_INT", "1")
    assert abs(kernel - reference) < 0.03 * reference  # int8 activations (a prompt's rows)


@pytest.mark.parametrize("group_size,sym,fmt", [(32, True, "gptq"), (64, False, "gptq_v2"), (-1, False, "gptq")],
                         ids=["g32-sym", "g64-asym-v2", "gall-asym"])
def test_gptq_4bit_runs_on_the_kernels(group_size, sym, fmt, float_model, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("FW_CPU_PACKED_INT", "1")
    tensors, weights = gptq_case.gptq_tensors(float_model, 4, group_size, False, sym, fmt, seed=abs(group_size))
    qcfg = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": False, "sym": sym,
            "checkpoint_format": fmt}
    path = qc.save_checkpoint(tmp_path / "ckpt", float_model, tokenizer, tensors, qcfg)
    _check_layers(make_llm(path), weights, repacked=True)
    _close_to_reference_path(path, monkeypatch)


@pytest.mark.parametrize("group_size,desc_act", [(16, False), (32, True)], ids=["g16", "g32-act-order"])
def test_gptq_layouts_the_kernels_cannot_read_keep_the_reference_path(group_size, desc_act, float_model, tokenizer,
                                                                       tmp_path, monkeypatch):
    monkeypatch.setenv("FW_CPU_PACKED_INT", "1")
    tensors, weights = gptq_case.gptq_tensors(float_model, 4, group_size, desc_act, True, "gptq", seed=1)
    qcfg = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act}
    path = qc.save_checkpoint(tmp_path / "ckpt", float_model, tokenizer, tensors, qcfg)
    _check_layers(make_llm(path), weights, repacked=False)


@pytest.mark.parametrize("group_size", [32, -1])
def test_awq_runs_on_the_kernels(group_size, float_model, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("FW_CPU_PACKED_INT", "1")
    tensors, weights = awq_case.awq_tensors(float_model, group_size)
    qcfg = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    path = qc.save_checkpoint(tmp_path / f"g{group_size}", float_model, tokenizer, tensors, qcfg)
    _check_layers(make_llm(path), weights, repacked=True)
    _close_to_reference_path(path, monkeypatch)


def test_a_short_last_group_repacks_exactly():
    """Groups of 64 over 96 inputs (GPTQ's last group is then 32 wide, as SmolLM2's 576 inputs in groups of
    128): every block of 32 takes its own group's scale and zero."""
    import types

    from fw.quantizers._packing import repack_for_kernels

    gen = torch.Generator().manual_seed(9)
    q = torch.randint(0, 16, (96, 40), generator=gen)
    zeros = torch.randint(0, 16, (2, 40), generator=gen).float()
    scales = (torch.rand(2, 40, generator=gen) * 0.05).half().float()
    layer = types.SimpleNamespace(device=torch.device("cpu"), qzeros=1, scales=2)
    assert repack_for_kernels(layer, q, zeros, scales, 64, drop=("qzeros", "scales"))
    assert not hasattr(layer, "qzeros") and layer.qweight.dtype == torch.uint8
    group = torch.arange(96) // 64
    w = (scales[group] * (q - zeros[group])).T.double()  # [out, in]
    x = torch.randn(3, 96, generator=gen)
    got = packed_int.packed_linear(x, layer.packed_int, fp32_out=True).double()
    want = packed_int.quantize_activations(x, 4).double() @ w.T
    assert (got - want).abs().max() <= 1e-3 * want.abs().max()
    assert not repack_for_kernels(types.SimpleNamespace(device=torch.device("cpu")), q, zeros, scales, 48, drop=())


def test_bitsandbytes_8bit_runs_on_the_packed_kernels(model_dirs, monkeypatch):
    """LLM.int8 weights (int8 codes, one absmax scale per row) on fw's packed kernels: widened to bf16 where the
    widening kernel is built (W8A16), else on the 8-bit kernel (W8A8); each linear within fp32 rounding of
    its activations (bf16, or int8 blocks) times the library's own dequantized weight."""
    import bitsandbytes.functional as BF
    from safetensors.torch import load_file

    monkeypatch.setenv("FW_CPU_PACKED_INT", "1")
    path = model_dirs["gqa"]
    tensors = load_file(str(path / "model.safetensors"))
    llm = make_llm(path, quantization="bitsandbytes-8bit")
    wide = packed_int.applies("cpu", 32, widening=True)
    checked = 0
    torch.manual_seed(0)
    for name, layer in llm.engine.loaded.model.named_modules():
        if not isinstance(layer, Linear) or name == "lm_head" or "layers." not in name:
            continue
        assert layer.packed_int is not None and layer.packed_int[0].bits == ("i8" if wide else 8), name
        parts = [tensors[f"{name.replace(fused, part)}.weight"] for fused, parts_ in
                 (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj")))
                 if name.endswith(fused) for part in parts_] or [tensors[f"{name}.weight"]]
        deq = []
        for w in parts:
            cb, scb, _ = BF.int8_vectorwise_quant(w.to(torch.float16).contiguous())
            deq.append(cb.double() * (scb.double() / 127).unsqueeze(1))
        x = torch.randn(5, layer.input_size)
        seen = x.bfloat16() if wide else packed_int.quantize_activations(x)
        want = seen.double() @ torch.cat(deq).T
        got = layer(x).double()
        assert (got - want).abs().max() <= 1e-3 * want.abs().max(), name  # W8A8's fp16 row scales: ~1e-4
        checked += 1
    assert checked == 4 * 3  # the tiny GQA model's 3 layers
