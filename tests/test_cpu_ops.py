"""The fused CPU layer ops (fw.kernels.cpu_ops) against the layers' torch code: the same numbers (bit for
bit in bf16/fp16 where no fp32 sum is involved), tails of every width, strided in-place rotary that leaves
the other columns alone, and a model that generates the same tokens with the ops on and off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import make_llm
from fw import SamplingParams
from fw.kernels.loader import missing_toolchain
from fw.layers import RMSNorm
from fw.kernels import cpu_ops
from fw.layers.rotary import _apply

pytestmark = pytest.mark.skipif(missing_toolchain() is not None, reason="no C++ toolchain to build the ops")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_ops.prepare("cpu") is None


@pytest.fixture
def torch_path(monkeypatch):
    """Run a block with the fused ops switched off (the layers' torch code)."""
    def off():
        monkeypatch.setattr(cpu_ops, "_ready", False)
    return off


def ulp_close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    """Equal up to one unit in the last place of `dtype` (fp32 sums ordered differently)."""
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(a.float(), b.float(), rtol=2 * eps, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [576, 100, 7])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_matches_torch(dtype, width, offset, monkeypatch):
    torch.manual_seed(width)
    x = torch.randn(19, width, dtype=dtype) * 3
    residual = torch.randn(19, width, dtype=dtype)
    norm = RMSNorm(width, 1e-5, dtype, weight_offset=offset)
    norm.weight.data.normal_()
    fused = norm(x)
    fused_sum_norm, fused_sum = norm(x, residual.clone())
    monkeypatch.setattr(cpu_ops, "_ready", False)
    ref = norm(x)
    ref_sum_norm, ref_sum = norm(x, residual.clone())
    assert torch.equal(fused_sum, ref_sum) and fused_sum.dtype == dtype
    assert fused.dtype == ref.dtype == dtype
    ulp_close(fused, ref, dtype)
    ulp_close(fused_sum_norm, ref_sum_norm, dtype)
    if dtype == torch.bfloat16:  # 8 mantissa bits: a one-ulp fp32 difference essentially never shows
        assert (fused != ref).float().mean() < 1e-3


def test_add_rms_norm_writes_the_sum_into_the_residual():
    x, residual, weight = torch.randn(4, 32), torch.randn(4, 32), torch.ones(32)
    expected = x + residual
    out, summed = cpu_ops.add_rms_norm(x, residual, weight, 1e-6, 0.0)
    assert summed is residual and torch.equal(residual, expected)
    assert not torch.equal(out, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (64, 32), (48, 48), (8, 8)])
def test_rotary_in_place_matches_torch_on_a_column_slice(dtype, head_dim, rotary_dim):
    torch.manual_seed(head_dim + rotary_dim)
    t, heads = 11, 5
    qkv = torch.randn(t, (heads + 2) * head_dim, dtype=dtype)
    cos, sin = torch.randn(t, rotary_dim, dtype=dtype), torch.randn(t, rotary_dim, dtype=dtype)
    untouched = qkv[:, heads * head_dim:].clone()
    expected = _apply(qkv[:, : heads * head_dim].clone(), cos.unsqueeze(1), sin.unsqueeze(1), head_dim, rotary_dim)
    out = cpu_ops.rotary_(qkv[:, : heads * head_dim], cos, sin, head_dim)
    assert torch.equal(out, expected)
    assert torch.equal(qkv[:, : heads * head_dim], expected)  # in place
    assert torch.equal(qkv[:, heads * head_dim:], untouched)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1536, 40, 3])
def test_silu_mul_matches_torch(dtype, inter):
    torch.manual_seed(inter)
    gate_up = torch.randn(13, 2 * inter, dtype=dtype) * 4
    gate, up = gate_up.split(inter, dim=-1)
    ref = F.silu(gate) * up
    out = cpu_ops.silu_mul(gate_up)
    assert out.shape == ref.shape and out.dtype == dtype
    ulp_close(out, ref, dtype)
    if dtype != torch.float32:
        assert (out != ref).float().mean() < 1e-3


def test_bad_shapes_are_refused():
    with pytest.raises(RuntimeError, match="rms_norm"):
        torch.ops.fw_cpu_ops.rms_norm(torch.randn(2, 8), torch.ones(4), 1e-6, 0.0, torch.empty(2, 8))
    with pytest.raises(RuntimeError, match="rotary"):
        cpu_ops.rotary_(torch.randn(3, 10), torch.randn(3, 4), torch.randn(3, 4), 4)
    with pytest.raises(RuntimeError, match="dtype"):
        cpu_ops.silu_mul(torch.randn(2, 8, dtype=torch.float64))


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv("FW_CPU_FUSED_OPS", "0")
    assert cpu_ops.prepare("cpu") == "FW_CPU_FUSED_OPS=0"
    assert not cpu_ops.ready()


def test_model_generates_the_same_tokens_with_and_without_the_ops(gqa_dir, monkeypatch):
    # the layers' Python forward, whose calls into cpu_ops are counted here (a replayed step makes the same
    # calls from C++: tests/test_step_program.py)
    monkeypatch.setenv("FW_CPU_STEP_PROGRAM", "0")
    calls = {"norm": 0, "rotary": 0, "silu": 0}
    for name, key in (("add_rms_norm", "norm"), ("rotary_", "rotary"), ("silu_mul", "silu")):
        original = getattr(cpu_ops, name)

        def counted(*args, _original=original, _key=key):
            calls[_key] += 1
            return _original(*args)
        monkeypatch.setattr(cpu_ops, name, counted)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)
    prompts = ["Hello world", "The engine schedules every request in pages.", "a"]
    fused = make_llm(gqa_dir).generate(prompts, params)
    assert all(calls.values()), calls  # the layers really took the fused path
    monkeypatch.setenv("FW_CPU_FUSED_OPS", "0")
    plain = make_llm(gqa_dir).generate(prompts, params)
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            token = next(iter(la))
            assert abs(la[token].logprob - lb[token].logprob) < 1e-4


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1, 15, 16, 17, 100, 4099])
def test_argmax_matches_torch_including_ties_nan_and_inf(dtype, width):
    torch.manual_seed(width)
    x = torch.randn(9, width).to(dtype)
    x[1] = 0.5  # all tied: the first index
    x[2] = float("-inf")
    if width > 3:
        x[3, width - 1] = float("inf")
        x[4, width // 2] = float("nan")  # a NaN is the maximum
        x[4, width - 1] = float("nan")
    assert torch.equal(cpu_ops.argmax(x), x.argmax(dim=-1))
