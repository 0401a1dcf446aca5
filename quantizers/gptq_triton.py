"""A Triton W4A16 matrix product on GPTQ's own 4-bit layout, for CUDA (the `gptq` method calls it).

Why: on CUDA the reference path dequantizes the whole weight on every call (column block by column block)
and then multiplies, which reads and writes the dense weight each step: the point of a 4-bit weight, four
times fewer bytes to read, is lost. This kernel reads the packed codes once per tile, unpacks and scales them
in registers and multiplies with `tl.dot` (fp32 accumulation), as vLLM's and AutoGPTQ's Triton kernels do.

Layout read as stored (no repack): qweight [K / 8, N] int32 (eight 4-bit codes along K, lowest bits first),
qzeros [G, N / 8] int32 (eight zeros along N), scales [G, N]; group g covers inputs g*group_size ..
(g+1)*group_size - 1 (contiguous groups; act-order checkpoints keep the reference path). w = (q - (z +
zero_offset)) * s, rounded to the activation dtype before the product, as the reference's dequantized
matrix is; fp32 products in IEEE fp32 (not TF32). Decode-sized inputs split K over more programs (fp32
partial sums added atomically), so a 1-row product still fills the GPU; above its W4A16_MAX_ROWS rows the
caller (fw.quantizers.gptq) dequantizes and runs a GEMM instead.

Imports triton at module level: `fw.quantizers.gptq` imports this module only when a CUDA layer first runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _w4a16_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, out_ptr, M, N, K, k_per_split, group_size, zero_offset,
                  stride_xm, stride_xk, stride_qk, stride_qn, stride_zg, stride_zn, stride_sg, stride_sn,
                  stride_om, stride_on, DTYPE: tl.constexpr, PRECISION: tl.constexpr, GROUP_PER_TILE: tl.constexpr,
                  ATOMIC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :] * stride_xk,
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        packed = tl.load(qw_ptr + (rk[:, None] // 8) * stride_qk + rn[None, :] * stride_qn,
                         mask=k_ok[:, None] & n_ok[None, :], other=0)
        q = (packed >> ((rk[:, None] % 8) * 4)) & 0xF
        if GROUP_PER_TILE:  # the tile lies in one group: one row of scales and zeros
            g = k0 // group_size
            s = tl.load(s_ptr + g * stride_sg + rn * stride_sn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            zp = tl.load(qz_ptr + g * stride_zg + (rn // 8) * stride_zn, mask=n_ok, other=0)
            z = (((zp >> ((rn % 8) * 4)) & 0xF) + zero_offset)[None, :]
        else:
            g = rk // group_size
            s = tl.load(s_ptr + g[:, None] * stride_sg + rn[None, :] * stride_sn,
                        mask=k_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
            zp = tl.load(qz_ptr + g[:, None] * stride_zg + (rn[None, :] // 8) * stride_zn,
                         mask=k_ok[:, None] & n_ok[None, :], other=0)
            z = ((zp >> ((rn[None, :] % 8) * 4)) & 0xF) + zero_offset
        w = ((q - z).to(tl.float32) * s).to(DTYPE)
        acc += tl.dot(x.to(DTYPE), w, input_precision=PRECISION)
    out = out_ptr + rm[:, None] * stride_om + rn[None, :] * stride_on
    if ATOMIC:  # split K: partial sums meet in an fp32 buffer
        tl.atomic_add(out, acc, mask=m_ok[:, None] & n_ok[None, :])
    else:
        tl.store(out, acc.to(DTYPE), mask=m_ok[:, None] & n_ok[None, :])


_TARGET_PROGRAMS = 512  # split K until about this many programs share the GPU at decode sizes


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                 group_size: int, zero_offset: int) -> torch.Tensor:
    """x [M, K] @ W [K, N] with W in GPTQ's 4-bit layout; [M, N] in x's dtype."""
    m, k = x.shape
    n = qweight.shape[1]
    if m == 0:
        return torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m, block_n, block_k = (16, 64, 128) if m <= 16 else (64, 64, 64)
    while block_k > 32 and group_size % block_k:
        block_k //= 2
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = max(1, min(triton.cdiv(k, block_k), _TARGET_PROGRAMS // tiles))
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)
    out = torch.zeros(m, n, dtype=torch.float32, device=x.device) if split > 1 else \
        torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split)
    with torch.cuda.device(x.device) if x.is_cuda else _no_device():
        _w4a16_kernel[grid](x, qweight, qzeros, scales, out, m, n, k, k_per_split, group_size, zero_offset,
                            x.stride(0), x.stride(1), qweight.stride(0), qweight.stride(1),
                            qzeros.stride(0), qzeros.stride(1), scales.stride(0), scales.stride(1),
                            out.stride(0), out.stride(1), DTYPE=_TL[x.dtype],
                            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                            GROUP_PER_TILE=group_size % block_k == 0, ATOMIC=split > 1,
                            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return out if split == 1 else out.to(x.dtype)


class _no_device:
    """The interpreter (TRITON_INTERPRET=1, CPU tensors) needs no device guard."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
