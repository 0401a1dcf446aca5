"""The CPU fast path's two choices: packed dense weights (fw.kernels.dense: fw's blocked bf16 layout on
AVX512-BF16 CPUs, oneDNN's otherwise) and `--dtype auto` (bf16 where the CPU has it natively, fp32
otherwise)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fw import LLM
from fw.layers import Linear, dense_linear, pack_dense_weight
from fw.kernels import dense
from fw.kernels.dense import cpu_packing_available
from fw.kernels import hardware
from fw.model import loader
from fw.model.source import ModelSource
from fw.plan import rules

needs_packing = pytest.mark.skipif(not cpu_packing_available(), reason="torch built without oneDNN")
needs_bf16_kernel = pytest.mark.skipif(not dense.bf16_kernel_ready(), reason="no AVX512-BF16 (or no compiler)")


def check_packed_matches_f_linear(weight: torch.Tensor, bias: torch.Tensor, packed: torch.Tensor) -> None:
    dtype, k = weight.dtype, weight.shape[1]
    x = torch.randn(2, 5, 2 * k, dtype=dtype)[..., ::2]  # 3-D and not contiguous
    # bf16: outputs are ~8 in size (64 unit products), where one bf16 step is 0.03-0.06
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.07, "rtol": 1.6e-2}
    for args in ((x, None), (x, bias), (x[0, :1], None), (x[:, :0], bias)):
        got, want = dense_linear(args[0], packed, args[1]), F.linear(args[0], weight, args[1])
        assert got.shape == want.shape and got.dtype == dtype
        torch.testing.assert_close(got, want, **tol)
    with pytest.raises(TypeError, match="dtype"):
        dense_linear(x.float() if dtype == torch.bfloat16 else x.bfloat16(), packed)


@needs_packing
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_onednn_packed_linear_equals_f_linear(dtype, monkeypatch):
    monkeypatch.setenv("FW_CPU_WEIGHT_PACKING", "onednn")
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64, dtype=dtype), torch.randn(96, dtype=dtype)
    packed = pack_dense_weight(weight, "cpu")
    assert packed.is_mkldnn and not weight.is_mkldnn
    check_packed_matches_f_linear(weight, bias, packed)


@needs_bf16_kernel
@pytest.mark.parametrize("n,k", [(96, 64), (100, 130), (88, 64), (1, 2), (49, 576)])
def test_blocked_bf16_linear_equals_f_linear(n, k):
    """Column counts off the 48-column blocks, input pairs across the 64-pair chunks, one output."""
    torch.manual_seed(0)
    weight, bias = torch.randn(n, k, dtype=torch.bfloat16), torch.randn(n, dtype=torch.bfloat16)
    packed = pack_dense_weight(weight, "cpu")
    assert dense.is_blocked_bf16(packed) and packed.shape == (n, k // 2, 2)
    check_packed_matches_f_linear(weight, bias, packed)


@needs_bf16_kernel
@pytest.mark.parametrize("rows", [1, 7, 8, 9, 64, 65, 600])
def test_blocked_bf16_rows_equal_fp32_sums_rounded(rows):
    """Every row count the kernel splits differently (tiles of 8, buffers of 64, regions of 512): the
    output is the fp32 sum rounded to bf16, up to the order of the fp32 sums (at most one bf16 step)."""
    torch.manual_seed(rows)
    n, k = 150, 448  # 4 blocks (the last partial), 224 pairs (4 chunks, the last partial)
    weight, x, bias = (torch.randn(n, k, dtype=torch.bfloat16), torch.randn(rows, k, dtype=torch.bfloat16),
                       torch.randn(n, dtype=torch.bfloat16))
    got = dense_linear(x, pack_dense_weight(weight, "cpu"), bias).float()
    exact = x.float() @ weight.float().t() + bias.float()
    step = exact.abs().clamp_min(1e-3) * 2.0 ** -7  # one bf16 step at each output's magnitude
    assert ((got - exact).abs() <= step).all()
    assert (got == exact.bfloat16().float()).float().mean() > 0.97  # mostly the same rounding


@needs_bf16_kernel
@pytest.mark.parametrize("rows,n", [(1, 4096), (64, 4096), (9, 100)])
def test_blocked_bf16_logits_are_the_unrounded_fp32_sums(rows, n):
    """The output layer's fp32 path (streaming stores where whole vectors are aligned, masked ones at a
    ragged end): the fp32 sums themselves, as close to exact as an fp32 matmul."""
    torch.manual_seed(0)
    weight, x = torch.randn(n, 576, dtype=torch.bfloat16), torch.randn(rows, 576, dtype=torch.bfloat16)
    logits = dense.dense_logits(x, pack_dense_weight(weight, "cpu"))
    exact = x.double() @ weight.double().t()
    assert logits.dtype == torch.float32 and logits.shape == (rows, n)
    fp32_error = ((x.float() @ weight.float().t()).double() - exact).abs().max()
    assert (logits.double() - exact).abs().max() <= 4 * fp32_error
    assert not torch.equal(logits, logits.bfloat16().float())  # not rounded to bf16 on the way


@needs_bf16_kernel
@pytest.mark.parametrize("rows,inter,k", [(1, 1536, 576), (64, 1536, 576), (9, 50, 64), (600, 30, 32), (3, 7, 2)])
def test_gate_up_packing_fuses_silu_bit_exactly(rows, inter, k):
    """A SiLU MLP's [gate; up] weight packed so each block holds matching gate and up columns (blocks of
    24 + 24, the last one ragged): the fused activation equals cpu_ops.silu_mul of the plain product to
    the bit, and the plain product through the fused layout equals the blocked one."""
    from fw.kernels import cpu_ops

    assert cpu_ops.prepare("cpu") is None
    torch.manual_seed(rows)
    weight, x = torch.randn(2 * inter, k, dtype=torch.bfloat16) * 0.1, torch.randn(rows, k, dtype=torch.bfloat16)
    plain, gated = pack_dense_weight(weight, "cpu"), pack_dense_weight(weight, "cpu", gate_up=True)
    assert dense.is_gate_up_bf16(gated) and not dense.is_blocked_bf16(gated) and gated.shape == (2, inter, k // 2, 2)
    product = dense_linear(x, plain)
    assert torch.equal(dense_linear(x, gated), product)
    assert torch.equal(dense.dense_silu_mul(x, gated), cpu_ops.silu_mul(product))
    with pytest.raises(ValueError, match="no bias"):
        dense_linear(x, gated, torch.zeros(2 * inter, dtype=torch.bfloat16))


def test_odd_input_size_stays_on_onednn():
    """The blocked layout pairs inputs; an odd input size keeps oneDNN's (or the plain) weight."""
    weight = torch.randn(8, 5, dtype=torch.bfloat16)
    packed = pack_dense_weight(weight, "cpu")
    assert not dense.is_blocked_bf16(packed)
    x = torch.randn(3, 5, dtype=torch.bfloat16)
    torch.testing.assert_close(dense_linear(x, packed), F.linear(x, weight), atol=0.07, rtol=1.6e-2)


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
    if dense.bf16_kernel_ready():  # fw's layout; the MLPs' gate/up packed for the fused SiLU
        assert linears and all(
            (dense.is_gate_up_bf16 if m.silu_gate_up else dense.is_blocked_bf16)(m.weight) for m in linears)
        assert sum(m.silu_gate_up for m in linears) == model.config.num_hidden_layers
        assert model.tied_head is None or dense.is_blocked_bf16(model.tied_head)
    else:
        assert linears and all(m.weight.is_mkldnn for m in linears)


@needs_bf16_kernel
@pytest.mark.parametrize("n,k,shards,gate_up", [
    (960, 64, [576, 192, 192], False),  # q, k, v on whole blocks of 48 rows
    (100, 8, [7, 41, 52], False),  # shards across block boundaries, a last block of 4 rows
    (47, 4, [47], False), (130, 2, [1] * 130, False),
    (3072, 32, [1536, 1536], True),  # gate, up
    (98, 6, [13, 36, 49], True),  # a shard across the gate/up boundary; a last block of 1 + 1 outputs
    (74, 10, [37, 37], True)])
def test_checkpoint_rows_go_straight_into_the_blocked_layout(n, k, shards, gate_up):
    """dense.pack_rows_into writes a weight's rows, shard by shard, as the C++ packer lays out the whole."""
    weight = torch.randn(n, k).to(torch.bfloat16)
    want = torch.ops.fw_dense.pack_bf16_gated(weight) if gate_up else torch.ops.fw_dense.pack_bf16(weight)
    got = dense.blocked_view(dense.blocked_bf16_buffer(n, k, "cpu"), n, k, gate_up)
    got.view(torch.int16).fill_(-1)
    first = 0
    for rows in shards:
        dense.pack_rows_into(got, weight[first:first + rows].float(), first)  # cast as a copy into bf16 would
        first += rows
    assert got.shape == want.shape and torch.equal(got.view(torch.int16), want.view(torch.int16))


@needs_bf16_kernel
def test_loaded_bf16_weights_are_the_packed_checkpoint(gqa_dir, monkeypatch):
    """A bf16 model's linear weights are written into the blocked layout as the checkpoint is read (no
    plain weight is packed afterwards): the same bytes as packing the fused plain weight."""
    from fw.layers import linear
    from fw.model.hf import iter_safetensors

    def no_plain_weight(weight, *args, **kwargs):
        raise AssertionError("a plain weight was loaded, then packed")

    monkeypatch.setattr(linear, "pack_dense", no_plain_weight)
    llm = LLM(str(gqa_dir), dtype="bfloat16", num_kv_blocks=16)
    layer = llm.engine.loaded.model.model.layers[0]
    tensors = {name: t.to(torch.bfloat16) for name, t in iter_safetensors(gqa_dir) if ".layers.0." in name}
    part = "model.layers.0.{}.weight".format
    qkv = torch.cat([tensors[part(f"self_attn.{p}_proj")] for p in "qkv"])
    gate_up = torch.cat([tensors[part("mlp.gate_proj")], tensors[part("mlp.up_proj")]])
    assert torch.equal(layer.self_attn.qkv_proj.weight, torch.ops.fw_dense.pack_bf16(qkv))
    assert torch.equal(layer.mlp.gate_up_proj.weight, torch.ops.fw_dense.pack_bf16_gated(gate_up))
    assert torch.equal(layer.mlp.down_proj.weight, torch.ops.fw_dense.pack_bf16(tensors[part("mlp.down_proj")]))


def test_cpu_flags_are_read_from_cpuinfo():
    x86 = "processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 avx512_vnni\n\nprocessor\t: 1\nflags\t: fpu\n"
    arm = "processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n"
    assert "avx512_bf16" in hardware.cpu_flags(x86) and "bf16" in hardware.cpu_flags(arm)
    assert hardware.cpu_flags("model name\t: something\n") == frozenset()


@pytest.mark.parametrize("native, expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_dtype_on_cpu_follows_native_bf16(monkeypatch, native, expected):
    monkeypatch.setattr(rules, "cpu_has_native_bf16", lambda: native)  # the dtype rule lives in fw.plan.rules
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
