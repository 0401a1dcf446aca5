"""Cases for fw.quantizers.gptq_triton's W4A16 kernel, shared by the interpreter run (CPU, a child process
with TRITON_INTERPRET=1: tests/test_gptq_triton.py) and the CUDA run (`pytest -m gpu`). The reference is
the GPTQ formula written here: W[i, o] = s[g(i), o] * (q[i, o] - (z[g(i), o] + zero_offset)), dequantized
to the activation dtype, then a float64 product."""

from __future__ import annotations

import torch

# (M, K, N, group_size, zero_offset): M around the 16-row tile, K not a multiple of the 128-input tile and a
# short last group (160 / 64), N a multiple of 8 (GPTQ packs zeros by 8) but not of the 64-column tile
CASES = [(1, 256, 64, 128, 1), (5, 384, 136, 64, 0), (17, 160, 72, 64, 1), (33, 128, 200, 32, 1),
         (70, 512, 64, 512, 0)]


def pack_case(k: int, n: int, group_size: int, gen: torch.Generator):
    """Random codes, zeros and scales, and the packed tensors in GPTQ's layout."""
    groups = -(-k // group_size)
    q = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
    z = torch.randint(0, 15, (groups, n), generator=gen, dtype=torch.int32)
    s = torch.rand(groups, n, generator=gen) * 0.02 + 1e-3
    qweight = torch.zeros(-(-k // 8), n, dtype=torch.int32)
    for j in range(8):
        rows = q[j::8]
        qweight[: rows.shape[0]] |= rows << (4 * j)
    qzeros = torch.zeros(groups, n // 8, dtype=torch.int32)
    for j in range(8):
        qzeros |= z[:, j::8] << (4 * j)
    return q, z, s, qweight, qzeros


def check(m: int, k: int, n: int, group_size: int, zero_offset: int, device: str, dtype: torch.dtype) -> float:
    """The kernel against the reference; returns the largest error relative to the largest output."""
    from fw.quantizers.gptq_triton import w4a16_matmul

    gen = torch.Generator().manual_seed(m * 7 + k + n)
    q, z, s, qweight, qzeros = pack_case(k, n, group_size, gen)
    scales = s.to(torch.float16)
    g = torch.arange(k) // group_size
    w = ((q - (z[g] + zero_offset)).float() * scales.float()[g]).to(dtype)
    x = torch.randn(m, k, generator=gen).to(dtype)
    want = x.double() @ w.double()
    got = w4a16_matmul(x.to(device), qweight.to(device), qzeros.to(device), scales.to(device), group_size,
                       zero_offset)
    assert got.dtype == dtype and got.shape == (m, n)
    return float((got.double().cpu() - want).abs().max() / want.abs().max())


def test_cases_under_the_interpreter():
    for case in CASES:
        err = check(*case, device="cpu", dtype=torch.float32)
        assert err < 1e-5, (case, err)


def test_awq_layer_repacked_for_the_kernel():
    """An AWQ layer built for CUDA is repacked into GPTQ's layout at load; the kernel on its tensors (zero
    offset 0) equals the checkpoint's dequantized weight."""
    from test_quant_awq import awq_layer_for_cuda

    from fw.quantizers.gptq_triton import w4a16_matmul

    for rows, (m, k, n, gs) in enumerate([(1, 256, 64, 128), (9, 160, 72, 32)]):
        layer, w = awq_layer_for_cuda(n, k, gs, seed=rows)
        x = torch.randn(m, k)
        got = w4a16_matmul(x, layer.qweight, layer.qzeros, layer.scales, gs, 0)
        want = x.double() @ w.double().T
        assert float((got.double() - want).abs().max() / want.abs().max()) < 1e-5
