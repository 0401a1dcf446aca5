"""The Triton W4A16 kernel the `gptq` and `awq` methods run on CUDA (fw.quantizers.gptq_triton).

On CPU: the kernel under the Triton interpreter against the GPTQ formula, and on an AWQ layer repacked at load
(tests/gptq_triton_cases.py, in a child pytest with TRITON_INTERPRET=1, which must be set before triton's first
import). On CUDA (`pytest -m gpu`): the same cases in bf16 and fp16 and GPTQ and AWQ models whose 4-bit layers
run it, against the dequantized weights; and its speed against the dequantize-then-multiply path it replaces (printed)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import gptq_triton_cases as cases
import test_quant_awq as awq_case
import quant_checkpoints as qc
import test_quant_gptq as gptq_case
from conftest import make_llm

HERE = Path(__file__).parent
HAS_TRITON = importlib.util.find_spec("triton") is not None


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_kernel_matches_the_gptq_and_awq_formulas_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                           str(HERE / "gptq_triton_cases.py")],
                          cwd=HERE.parent, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "2 passed" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", cases.CASES + [(1, 4096, 4096, 128, 1), (256, 4096, 11008, 128, 0)])
def test_kernel_on_cuda(case, dtype):
    err = cases.check(*case, device="cuda", dtype=dtype)
    assert err < 2e-2, (case, err)  # bf16 output rounding (2^-8) of sums over K


@pytest.fixture(scope="module")
def float_model(tokenizer):
    return qc.float_llama(tokenizer, seed=3)


def _gptq_checkpoint(float_model):
    tensors, weights = gptq_case.gptq_tensors(float_model, 4, 32, False, False, "gptq", seed=5)
    return tensors, weights, {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": False}


def _awq_checkpoint(float_model):  # repacked into GPTQ's layout at load, for the same kernel
    tensors, weights = awq_case.awq_tensors(float_model, 32)
    return tensors, weights, {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_model_runs_the_kernel_on_cuda(method, float_model, tokenizer, tmp_path, monkeypatch):
    from fw.quantizers import gptq_triton
    from fw.quantizers.awq import AWQLinearMethod
    from fw.quantizers.gptq import GPTQLinearMethod

    calls = []
    real = gptq_triton.w4a16_matmul
    monkeypatch.setattr(gptq_triton, "w4a16_matmul", lambda *a: calls.append(1) or real(*a))
    tensors, weights, qcfg = (_gptq_checkpoint if method == "gptq" else _awq_checkpoint)(float_model)
    path = qc.save_checkpoint(tmp_path / method, float_model, tokenizer, tensors, qcfg)
    llm = make_llm(path, device="cuda")
    method_cls = GPTQLinearMethod if method == "gptq" else AWQLinearMethod
    assert qc.check_linear_outputs(llm, weights, method_cls, device="cuda") == 8
    assert calls


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_speed_against_dequantize_then_multiply(capsys):
    """Printed, not asserted: a 4096 x 11008 layer (Llama-7B's MLP), bf16, group 128."""
    from fw.quantizers.gptq_triton import w4a16_matmul

    k, n, gs = 4096, 11008, 128
    q, z, s, qweight, qzeros = cases.pack_case(k, n, gs, torch.Generator().manual_seed(0))
    qweight, qzeros, scales = qweight.cuda(), qzeros.cuda(), s.half().cuda()
    z_full, g = z.cuda(), torch.arange(k, device="cuda") // gs

    def dequantized(x):
        codes = torch.stack([(qweight >> (4 * j)) & 0xF for j in range(8)], 1).view(k, n)
        w = ((codes - (z_full[g] + 1)).float() * scales.float()[g]).to(x.dtype)
        return x @ w

    def timed(fn, x):
        for _ in range(3):
            fn(x)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            fn(x)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / 20 * 1e6

    with capsys.disabled():
        for m in (1, 16, 64, 256):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            tk = timed(lambda x: w4a16_matmul(x, qweight, qzeros, scales, gs, 1), x)
            td = timed(dequantized, x)
            gbs = (k * n / 2 + k * n / gs * 2.5) / tk / 1e3
            print(f"\nW4A16 {m}x{k}x{n}: triton {tk:.1f} us ({gbs:.0f} GB/s of packed weight), "
                  f"dequantize+matmul {td:.1f} us, {td / tk:.1f}x")
