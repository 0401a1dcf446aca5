"""AWQ (GEMM layout): a tiny random Llama packed by the test into AutoAWQ's on-disk format
(interleaved nibble order, asymmetric zeros, several group sizes), loaded by fw: each linear
against the test's own dequantized weights, and greedy generation against transformers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import quant_checkpoints as qc
from conftest import make_llm
from fw.errors import ConfigError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of an int32 holds output column 8c + AWQ_ORDER[j]


def awq_tensors(model, group_size: int):
    tensors, weights = {}, {}
    for i in range(model.config.num_hidden_layers):
        for proj in qc.PROJECTIONS:
            name = f"model.layers.{i}.{proj}"
            w = model.get_parameter(name + ".weight").detach()
            cols = w.shape[1]
            size = cols if group_size == -1 else group_size
            q, zeros, scales = qc.quantize(w, 4, np.arange(cols) // size, cols // size, sym=False)
            tensors[name + ".qweight"] = torch.from_numpy(qc.pack_columns(q, 4, AWQ_ORDER))
            tensors[name + ".qzeros"] = torch.from_numpy(qc.pack_columns(zeros, 4, AWQ_ORDER))
            tensors[name + ".scales"] = torch.from_numpy(scales)
            weights[name] = dequantize(tensors, name, size)
    return tensors, weights


def dequantize(tensors: dict, name: str, group_size: int) -> torch.Tensor:
    """The published formula: W[o, i] = s[i // gs, o] * (q[i, o] - z[i // gs, o])."""
    q = qc.unpack_columns(tensors[name + ".qweight"].numpy(), 4, AWQ_ORDER)
    z = qc.unpack_columns(tensors[name + ".qzeros"].numpy(), 4, AWQ_ORDER)
    s = tensors[name + ".scales"].numpy().astype(np.float64)
    g = np.arange(q.shape[0]) // group_size
    return torch.from_numpy((s[g] * (q - z[g])).T.copy()).float()


@pytest.fixture(autouse=True)
def reference_path(monkeypatch):
    """The plain-torch path, exactly (fw's packed-int kernels quantize activations to int8; their tests are
    in test_quant_int4_kernels.py)."""
    monkeypatch.setenv("FW_CPU_PACKED_INT", "0")


@pytest.fixture(scope="module")
def float_model(tokenizer):
    return qc.float_llama(tokenizer, seed=11)


def test_pack_order_is_awq_interleaving():
    values = np.arange(8).reshape(1, 8)
    word = int(qc.pack_columns(values, 4, AWQ_ORDER)[0, 0]) & 0xFFFFFFFF
    assert word == 0x75316420  # nibbles 0..7 hold columns 0, 2, 4, 6, 1, 3, 5, 7


@pytest.mark.parametrize("group_size", [16, 32, -1])
def test_awq_checkpoint_matches_dequantized_reference(group_size, float_model, tokenizer, tmp_path):
    tensors, weights = awq_tensors(float_model, group_size)
    qcfg = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    path = qc.save_checkpoint(tmp_path / f"g{group_size}", float_model, tokenizer, tensors, qcfg)
    llm = make_llm(path)
    assert llm.engine.loaded.quantization == "awq"
    from fw.quantizers.awq import AWQLinearMethod

    assert qc.check_linear_outputs(llm, weights, AWQLinearMethod) == 4 * float_model.config.num_hidden_layers
    qc.check_generation(llm, qc.dequantized_model(float_model, weights), tokenizer)
    held, dense = qc.dense_bytes(llm)
    assert held < dense * (4 / 16 + 0.15)
    layer = llm.engine.loaded.model.model.layers[0].mlp.gate_up_proj
    assert {n for n, _ in layer.named_parameters()} == {"qweight", "qzeros", "scales"}
    assert layer.qweight.shape == (64, 2 * 128 // 8)


def test_awq_rejects_layouts_it_cannot_read():
    from fw.quantizers.awq import AWQLinearMethod

    with pytest.raises(ConfigError, match="version 'gemv'"):
        AWQLinearMethod({"quant_method": "awq", "bits": 4, "version": "gemv"})
    with pytest.raises(ConfigError, match="8-bit weights are not supported"):
        AWQLinearMethod({"quant_method": "awq", "bits": 8})
    with pytest.raises(ConfigError, match="zero_point false"):
        AWQLinearMethod({"quant_method": "awq", "bits": 4, "zero_point": False})


def test_awq_modules_to_not_convert_stay_float(float_model, tokenizer, tmp_path):
    tensors, weights = awq_tensors(float_model, 32)
    tensors = {n: t for n, t in tensors.items() if ".mlp.down_proj." not in n}  # down_proj kept in float
    qcfg = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm",
            "modules_to_not_convert": ["down_proj"]}
    path = qc.save_checkpoint(tmp_path / "skip", float_model, tokenizer, tensors, qcfg)
    llm = make_llm(path)
    layer = llm.engine.loaded.model.model.layers[1].mlp.down_proj
    assert hasattr(layer, "weight") and not hasattr(layer, "qweight")
    for name in list(weights):
        if name.endswith("down_proj"):
            weights[name] = float_model.get_parameter(name + ".weight").detach()
    qc.check_generation(llm, qc.dequantized_model(float_model, weights), tokenizer)


def awq_layer_for_cuda(rows: int, cols: int, group_size: int, seed: int):
    """An AWQ Linear built for a CUDA engine (loaded on the CPU, as fw loads), from random weights packed the
    way AutoAWQ packs them; with its dequantized weight [out, in] by the published formula."""
    from fw.layers import Linear
    from fw.layers.context import ModelContext
    from fw.quantizers.awq import AWQLinearMethod

    torch.manual_seed(seed)
    w = torch.randn(rows, cols)
    q, zeros, scales = qc.quantize(w, 4, np.arange(cols) // group_size, cols // group_size, sym=False)
    tensors = {"p.qweight": torch.from_numpy(qc.pack_columns(q, 4, AWQ_ORDER)),
               "p.qzeros": torch.from_numpy(qc.pack_columns(zeros, 4, AWQ_ORDER)),
               "p.scales": torch.from_numpy(scales)}
    method = AWQLinearMethod({"quant_method": "awq", "bits": 4, "group_size": group_size, "version": "gemm"})
    ctx = ModelContext(torch.float32, torch.device("cuda"), object, method)
    layer = Linear(cols, rows, ctx, "model.layers.0.mlp.down_proj")
    for name in ("qweight", "qzeros", "scales"):
        layer.load_weight(name, tensors["p." + name])
    layer.method.process_weights_after_loading(layer)
    return layer, dequantize(tensors, "p", group_size)


def test_awq_layer_for_cuda_is_repacked_into_gptq_layout():
    """On CUDA an AWQ layer is repacked at load into GPTQ's layout (what gptq_triton reads): the same bytes,
    and the codes it holds still dequantize to the checkpoint's weight (the reference path reads them)."""
    layer, w = awq_layer_for_cuda(72, 160, 32, seed=4)
    assert layer.awq_gptq_layout and layer.packed_int is None
    assert layer.qweight.shape == (160 // 8, 72) and layer.qzeros.shape == (5, 72 // 8)
    x = torch.randn(5, 160)
    torch.testing.assert_close(layer(x).double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-5)
