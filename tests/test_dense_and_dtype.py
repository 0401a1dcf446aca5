"""The CPU fast path's two choices: oneDNN-packed dense weights (fw.layers.dense) and `--dtype auto`
(bf16 where the CPU has it natively, fp32 otherwise)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fw import LLM
from fw.layers import Linear, dense_linear, pack_dense_weight
from fw.layers.dense import cpu_packing_available
from fw.model_loader import hardware, loader
from fw.model_loader.source import ModelSource

needs_packing = pytest.mark.skipif(not cpu_packing_available(), reason="torch built without oneDNN")


@needs_packing
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_linear_equals_f_linear(dtype):
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64, dtype=dtype), torch.randn(96, dtype=dtype)
    packed = pack_dense_weight(weight, "cpu")
    assert packed.is_mkldnn and not weight.is_mkldnn
    x = torch.randn(2, 5, 128, dtype=dtype)[..., ::2]  # 3-D and not contiguous
    # bf16: outputs are ~8 in size (64 unit products), where one bf16 step is 0.03-0.06
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.07, "rtol": 1.6e-2}
    for args in ((x, None), (x, bias), (x[0, :1], None), (x[:, :0], bias)):
        got, want = dense_linear(args[0], packed, args[1]), F.linear(args[0], weight, args[1])
        assert got.shape == want.shape and got.dtype == dtype
        torch.testing.assert_close(got, want, **tol)
    with pytest.raises(TypeError, match="dtype"):
        dense_linear(x.float() if dtype == torch.bfloat16 else x.bfloat16(), packed)


def test_packing_applies_only_where_it_helps(monkeypatch):
    weight = torch.randn(8, 4, dtype=torch.bfloat16)
    assert pack_dense_weight(weight, "cuda") is weight  # the model will run elsewhere: keep it movable
    assert pack_dense_weight(weight.half(), "cpu").dtype == torch.float16  # no packed fp16 path
    monkeypatch.setenv("FW_CPU_WEIGHT_PACKING", "0")
    assert pack_dense_weight(weight, "cpu") is weight
    assert torch.equal(dense_linear(torch.ones(1, 4, dtype=torch.bfloat16), weight), F.linear(
        torch.ones(1, 4, dtype=torch.bfloat16), weight))


@needs_packing
def test_loaded_model_runs_on_packed_weights(gqa_dir):
    llm = LLM(str(gqa_dir), dtype="bfloat16", num_kv_blocks=16)
    model = llm.engine.loaded.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.weight.is_mkldnn for m in linears)


def test_cpu_flags_are_read_from_cpuinfo():
    x86 = "processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 avx512_vnni\n\nprocessor\t: 1\nflags\t: fpu\n"
    arm = "processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n"
    assert "avx512_bf16" in hardware.cpu_flags(x86) and "bf16" in hardware.cpu_flags(arm)
    assert hardware.cpu_flags("model name\t: something\n") == frozenset()


@pytest.mark.parametrize("native, expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_dtype_on_cpu_follows_native_bf16(monkeypatch, native, expected):
    monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda: native)
    cpu = torch.device("cpu")
    for kind in ("gguf", "directory"):
        source = ModelSource(kind=kind, path=None, name="m")
        for config_dtype in ("float32", "bfloat16", "float16"):
            hf_config = type("Config", (), {"dtype": config_dtype})()
            assert loader.resolve_dtype("auto", hf_config, source, cpu) == expected
    assert loader.resolve_dtype("float32", None, source, cpu) == torch.float32  # explicit wins


def test_auto_dtype_on_gpu_keeps_the_checkpoints():
    gpu = torch.device("cuda")
    config = type("Config", (), {"dtype": "float16"})()
    assert loader.resolve_dtype("auto", config, ModelSource(kind="directory", path=None, name="m"), gpu) == torch.float16
