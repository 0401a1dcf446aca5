"""Choosing a quantization method: a checkpoint format no plugin reads, a plugin that cannot run
on this device, an architecture that opts out of methods, and MoE checkpoints whose experts
(not `fw.layers.Linear`) are quantized versus ones whose experts stay float."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import quant_checkpoints as qc
import tiny_moe
from conftest import make_llm
from fw.config import EngineConfig
from fw.errors import UnsupportedConfigurationError
from fw.model.loader import _quantization
from fw.model.quantized_weights import check_method_supported
from fw.plugins import ArchitectureSpec, QuantizationMethodSpec
from fw.plugins.registry import Registry

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": False, "sym": True}


def with_quant_config(src, dst, quant_config: dict, tensors: dict | None = None, drop: tuple[str, ...] = ()):
    """Copy checkpoint dir `src` to `dst` with `quantization_config` set, tensors `drop`ped by
    name fragment and `tensors` added."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    state = {}
    for f in src.glob("*.safetensors"):
        state.update(load_file(str(f)))
    state = {n: t for n, t in state.items() if not any(d in n for d in drop)}
    save_file({**state, **(tensors or {})}, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quant_config
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def gptq_pack(w: torch.Tensor, name: str, group_size: int = 16) -> tuple[dict, torch.Tensor]:
    """4-bit symmetric GPTQ v1 tensors for weight `w` [out, in], and their dequantized weight."""
    g_idx = np.arange(w.shape[1]) // group_size
    q, zeros, scales = qc.quantize(w, 4, g_idx, w.shape[1] // group_size, sym=True)
    deq = torch.from_numpy((scales.astype(np.float64)[g_idx] * (q - zeros[g_idx])).T.copy()).float()
    return {name + ".qweight": torch.from_numpy(qc.pack_rows(q, 4)),
            name + ".qzeros": torch.from_numpy(qc.pack_columns(zeros - 1, 4)),
            name + ".scales": torch.from_numpy(scales), name + ".g_idx": torch.from_numpy(g_idx.astype(np.int32))}, deq


# -- no plugin for the format; a plugin that cannot run here ---------------------------------------


def test_quant_method_without_plugin_names_it_and_the_installed_ones(gqa_dir, tmp_path):
    path = with_quant_config(gqa_dir, tmp_path / "hqq", {"quant_method": "hqq", "nbits": 4})
    with pytest.raises(UnsupportedConfigurationError) as err:
        make_llm(path)
    message = str(err.value)
    assert "hqq" in message and "no installed quantization plugin" in message
    for installed in ("gptq", "awq"):
        assert installed in message


def _select(spec: QuantizationMethodSpec, quantization: str | None, qcfg: dict | None = None):
    registry = Registry("quantization_method")
    registry.add(spec, "test", "test-dist")
    plugins = SimpleNamespace(registry=lambda kind: registry)
    arch = ArchitectureSpec(name="llama", hf_architectures=("LlamaForCausalLM",), build=lambda *a: None)
    hf_config = SimpleNamespace(quantization_config=qcfg)
    return _quantization(EngineConfig(quantization=quantization), hf_config, arch, plugins, torch.device("cpu"))


def test_plugin_for_another_device_is_rejected_with_its_reason():
    spec = QuantizationMethodSpec(name="gpu-only", factory=lambda q: object(), devices=("cuda",),
                                  detects=lambda q: q.get("quant_method") == "gpu-only")
    with pytest.raises(UnsupportedConfigurationError, match=r"'gpu-only' cannot run here: device 'cpu' not "
                                                            r"supported \(supports cuda\)"):
        _select(spec, "gpu-only")
    with pytest.raises(UnsupportedConfigurationError, match="device 'cpu' not supported"):
        _select(spec, None, {"quant_method": "gpu-only"})  # detected from the checkpoint: same check


def test_plugin_declaring_itself_unavailable_is_rejected_with_its_reason():
    spec = QuantizationMethodSpec(name="needs-kernels", factory=lambda q: object(),
                                  available=lambda: "the fancy_kernels package is not installed")
    with pytest.raises(UnsupportedConfigurationError, match="'needs-kernels' cannot run here: the fancy_kernels "
                                                            "package is not installed"):
        _select(spec, "needs-kernels")
    ok = QuantizationMethodSpec(name="fine", factory=lambda q: ("built", q), available=lambda: None)
    assert _select(ok, "fine") == ("fine", ("built", {}))


# -- which architectures take which methods -----------------------------------------------------------


def test_architecture_rule_every_linear_method_unless_it_opts_out():
    def spec(supported):
        return ArchitectureSpec(name="fam", hf_architectures=(), build=lambda *a: None,
                                supported_quantization=supported)

    check_method_supported(spec(None), "gptq")  # the default: built from fw.layers.Linear, takes every method
    check_method_supported(spec(("awq",)), "awq")
    with pytest.raises(UnsupportedConfigurationError, match="does not support quantization 'gptq'; it supports awq"):
        check_method_supported(spec(("awq",)), "gptq")
    with pytest.raises(UnsupportedConfigurationError, match="takes no quantization method"):
        check_method_supported(spec(()), "fp8")


def test_builtin_families_accept_linear_methods():
    from fw.plugins.manager import get_plugin_manager

    archs = get_plugin_manager().registry("architecture")
    for name in ("llama", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "mixtral", "qwen2_moe", "qwen3_moe"):
        for method in ("gptq", "awq", "fp8"):
            check_method_supported(archs.get(name), method)


# -- MoE: experts are not Linear --------------------------------------------------------------------


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("mixtral") / "float"
    return tiny_moe.build_model(tiny_moe.MIXTRAL, tokenizer, path)


def test_moe_checkpoint_with_quantized_experts_fails_clearly(mixtral, tmp_path):
    state = load_file(str(next(mixtral.glob("*.safetensors"))))
    expert = next(n for n in state if ".experts.0.w1.weight" in n)
    packed, _ = gptq_pack(state[expert], expert.removesuffix(".weight"))
    path = with_quant_config(mixtral, tmp_path / "q", GPTQ, packed, drop=(expert,))
    with pytest.raises(UnsupportedConfigurationError, match=r"quantized \(gptq\) including its MoE experts.*"
                                                            r"outside fw.layers.Linear"):
        make_llm(path)


def test_moe_checkpoint_with_quantized_attention_and_float_experts_matches_transformers(mixtral, tmp_path,
                                                                                       tokenizer):
    from fw.quantizers.gptq import GPTQLinearMethod

    state = load_file(str(next(mixtral.glob("*.safetensors"))))
    packed, weights = {}, {}
    for name in [n for n in state if ".self_attn." in n and n.endswith("_proj.weight")]:
        tensors, deq = gptq_pack(state[name], name.removesuffix(".weight"))
        packed.update(tensors)
        weights[name.removesuffix(".weight")] = deq
    path = with_quant_config(mixtral, tmp_path / "q", GPTQ, packed, drop=tuple(f"{n}.weight" for n in weights))
    llm = make_llm(path)
    attn = llm.engine.loaded.model.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj.method, GPTQLinearMethod) and isinstance(attn.o_proj.method, GPTQLinearMethod)
    hf = tiny_moe.load_hf(tiny_moe.MIXTRAL, mixtral)
    qc.check_generation(llm, qc.dequantized_model(hf, weights), tokenizer)


# -- a checkpoint's unquantized-module lists name its projections, fw fuses them ---------------------

QKV = "model.layers.0.self_attn.qkv_proj"
ATTN = "model.layers.0.self_attn."


def _fp8(ignored):
    from fw.quantizers.fp8 import make_method

    return make_method({"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": ignored})


def _bnb(skipped):
    from fw.quantizers.bitsandbytes import make_factory

    return make_factory("bitsandbytes-8bit")({"quant_method": "bitsandbytes", "load_in_8bit": True,
                                              "llm_int8_skip_modules": skipped})


def _gptq(not_converted):
    from fw.quantizers.gptq import GPTQLinearMethod

    return GPTQLinearMethod({"quant_method": "gptq", "bits": 4, "group_size": 32,
                             "modules_to_not_convert": not_converted})


@pytest.mark.parametrize("method, skip_all, skip_some", [
    (_fp8, [ATTN + "q_proj", ATTN + "k_proj", ATTN + "v_proj"], [ATTN + "q_proj"]),
    (_fp8, ["re:model\\.layers\\.0\\.self_attn\\.[qkv]_proj"], ["re:.*\\.0\\.self_attn\\.[qk]_proj"]),
    (_bnb, [ATTN + "q_proj", ATTN + "k_proj", ATTN + "v_proj"], ["0.self_attn.v_proj"]),
    (_gptq, [ATTN + "q_proj", ATTN + "k_proj", ATTN + "v_proj"], [ATTN + "k_proj"]),
])
def test_a_fused_layer_is_unquantized_when_every_projection_it_fuses_is_listed(method, skip_all, skip_some):
    """Lists name the checkpoint's q/k/v_proj; fw's layer is the fused qkv_proj. All of them listed: the
    fused layer stays float. Some: it cannot be one layer, and the error names which are which."""
    from fw.errors import ModelLoadError
    from fw.layers.linear import UnquantizedLinearMethod

    all_listed = method(skip_all)
    assert isinstance(all_listed.method_for(QKV), UnquantizedLinearMethod)
    assert not isinstance(all_listed.method_for("model.layers.1.self_attn.qkv_proj"), UnquantizedLinearMethod)
    assert not isinstance(all_listed.method_for("model.layers.0.mlp.gate_up_proj"), UnquantizedLinearMethod)
    assert isinstance(all_listed.method_for("lm_head"), UnquantizedLinearMethod)
    with pytest.raises(ModelLoadError, match=r"qkv_proj: the checkpoint leaves .*unquantized but quantizes .*"
                                             r"fused layer"):
        method(skip_some).method_for(QKV)
