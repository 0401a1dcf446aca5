"""GPTQ: a tiny random Llama packed by the test into GPTQ's on-disk format (4 and 8 bits,
several group sizes and -1, desc_act with a shuffled g_idx, sym and asym, v1 and v2 zeros),
loaded by fw: each linear against the test's own dequantized weights, and greedy generation
against transformers on those weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import quant_checkpoints as qc
from conftest import make_llm
from fw.errors import ConfigError, ModelLoadError

CASES = {
    # name: (bits, group_size, desc_act, sym, checkpoint_format)
    "4bit-g16-sym": (4, 16, False, True, "gptq"),
    "4bit-g32-asym-act": (4, 32, True, False, "gptq"),
    "8bit-gall-asym": (8, -1, False, False, "gptq"),
    "8bit-g16-sym-act": (8, 16, True, True, "gptq"),
    "4bit-g32-asym-v2": (4, 32, False, False, "gptq_v2"),
    "4bit-g48-asym": (4, 48, False, False, "gptq"),
    "2bit-g32-asym": (2, 32, False, False, "gptq"),  # groups that do not divide the input: a short last group
    "4bit-g16-asym-act-lmhead": (4, 16, True, False, "gptq"),  # GPTQModel's lm_head: true
}


def gptq_tensors(model, bits: int, group_size: int, desc_act: bool, sym: bool, fmt: str, seed: int,
                 lm_head: bool = False):
    """(checkpoint tensors, dequantized [out, in] weights) for every projection of `model` (and the LM head)."""
    rng = np.random.default_rng(seed)
    tensors, weights = {}, {}
    names = [f"model.layers.{i}.{proj}" for i in range(model.config.num_hidden_layers) for proj in qc.PROJECTIONS]
    for name in names + (["lm_head"] if lm_head else []):
        w = model.get_parameter(name + ".weight").detach()
        cols = w.shape[1]
        size = cols if group_size == -1 else group_size
        groups = -(-cols // size)
        if desc_act:  # act order: channels quantized in a permuted order, grouped in that order
            perm = rng.permutation(cols)
            g_idx = np.empty(cols, dtype=np.int64)
            g_idx[perm] = np.arange(cols) // size
        else:
            g_idx = np.arange(cols) // size
        v1 = fmt == "gptq"
        q, zeros, scales = qc.quantize(w, bits, g_idx, groups, sym, min_zero=1 if v1 else 0)
        stored_zeros = zeros - 1 if v1 else zeros
        tensors[name + ".qweight"] = torch.from_numpy(qc.pack_rows(q, bits))
        tensors[name + ".qzeros"] = torch.from_numpy(qc.pack_columns(stored_zeros, bits))
        tensors[name + ".scales"] = torch.from_numpy(scales)
        tensors[name + ".g_idx"] = torch.from_numpy(g_idx.astype(np.int32))
        weights[name] = dequantize(tensors, name, bits, v1)
    return tensors, weights


def dequantize(tensors: dict, name: str, bits: int, v1: bool) -> torch.Tensor:
    """The published formula on the packed tensors: W[o, i] = s[g[i], o] * (q[i, o] - z[g[i], o])."""
    q = qc.unpack_rows(tensors[name + ".qweight"].numpy(), bits)
    z = qc.unpack_columns(tensors[name + ".qzeros"].numpy(), bits) + (1 if v1 else 0)
    s = tensors[name + ".scales"].numpy().astype(np.float64)
    g = tensors[name + ".g_idx"].numpy().astype(np.int64)
    return torch.from_numpy((s[g] * (q - z[g])).T.copy()).float()


@pytest.fixture(autouse=True)
def reference_path(monkeypatch):
    """The plain-torch path, exactly (fw's packed-int kernels quantize activations to int8; their tests are
    in test_quant_int4_kernels.py)."""
    monkeypatch.setenv("FW_CPU_PACKED_INT", "0")


@pytest.fixture(scope="module")
def float_model(tokenizer):
    return qc.float_llama(tokenizer)


@pytest.mark.parametrize("case", list(CASES))
def test_gptq_checkpoint_matches_dequantized_reference(case, float_model, tokenizer, tmp_path):
    bits, group_size, desc_act, sym, fmt = CASES[case]
    lm_head = case.endswith("lmhead")
    tensors, weights = gptq_tensors(float_model, bits, group_size, desc_act, sym, fmt, seed=len(case), lm_head=lm_head)
    if desc_act:
        assert any(not torch.equal(t, t.sort().values) for n, t in tensors.items() if n.endswith("g_idx"))
    qcfg = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym,
            "checkpoint_format": fmt, "lm_head": lm_head}
    path = qc.save_checkpoint(tmp_path / case, float_model, tokenizer, tensors, qcfg)
    llm = make_llm(path)  # detected from quantization_config, no --quantization
    assert llm.engine.loaded.quantization == "gptq"
    from fw.quantizers.gptq import GPTQLinearMethod

    layers = 4 * float_model.config.num_hidden_layers + lm_head
    assert qc.check_linear_outputs(llm, weights, GPTQLinearMethod) == layers
    qc.check_generation(llm, qc.dequantized_model(float_model, weights), tokenizer)

    held, dense = qc.dense_bytes(llm)  # packed in memory: about bits/16 of fp16 plus scales and zeros
    assert held < dense * (bits / 16 + 0.15)


def test_gptq_memory_stays_packed(float_model, tokenizer, tmp_path):
    tensors, _ = gptq_tensors(float_model, 4, 32, False, True, "gptq", seed=0)
    path = qc.save_checkpoint(tmp_path / "ckpt", float_model, tokenizer, tensors,
                              {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False})
    llm = make_llm(path)
    layer = llm.engine.loaded.model.model.layers[0].self_attn.qkv_proj
    assert {n for n, _ in layer.named_parameters()} == {"qweight", "qzeros", "scales", "g_idx"}
    assert layer.qweight.dtype == torch.int32 and layer.qweight.shape == (64 // 8, 64 + 32 + 32)
    llm.generate(["Hello"], __import__("fw").SamplingParams(max_tokens=2))
    assert {n for n, _ in layer.named_parameters()} == {"qweight", "qzeros", "scales", "g_idx"}


def test_gptq_rejects_unsupported_configs():
    from fw.quantizers.gptq import GPTQLinearMethod

    with pytest.raises(ConfigError, match="3-bit weights are not supported"):
        GPTQLinearMethod({"quant_method": "gptq", "bits": 3, "group_size": 128})
    with pytest.raises(ConfigError, match="checkpoint_format 'marlin'"):
        GPTQLinearMethod({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"})
    with pytest.raises(ConfigError, match="group_size 0"):
        GPTQLinearMethod({"quant_method": "gptq", "bits": 4, "group_size": 0})
    with pytest.raises(ConfigError, match="no quantization_config"):
        GPTQLinearMethod({})


def test_gptq_checkpoint_with_wrong_shapes_fails_clearly(float_model, tokenizer, tmp_path):
    tensors, _ = gptq_tensors(float_model, 4, 32, False, True, "gptq", seed=0)
    path = qc.save_checkpoint(tmp_path / "ckpt", float_model, tokenizer, tensors,
                              {"quant_method": "gptq", "bits": 4, "group_size": 16})  # says 16, packed with 32
    with pytest.raises(ModelLoadError, match=r"(qzeros|scales): checkpoint shape"):
        make_llm(path)


def test_gptq_block_wise_dequantization_matches(float_model, tokenizer, tmp_path, monkeypatch):
    """Small column blocks (several per fused layer, some crossing q/k/v shard edges) give the same outputs."""
    import fw.quantizers._packing as packing
    from fw.quantizers.gptq import GPTQLinearMethod

    monkeypatch.setattr(packing, "BLOCK_VALUES", 64 * 24)  # 24 columns per block at 64 inputs
    for desc_act in (False, True):
        tensors, weights = gptq_tensors(float_model, 4, 16, desc_act, False, "gptq", seed=5)
        path = qc.save_checkpoint(tmp_path / f"act{desc_act}", float_model, tokenizer, tensors,
                                  {"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": desc_act})
        assert qc.check_linear_outputs(make_llm(path), weights, GPTQLinearMethod) == 8
