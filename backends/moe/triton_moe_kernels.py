"""The Triton kernels of the `triton` MoE kernel plugin, in the shape of vLLM/SGLang's fused_moe.

Imports triton at module level, so the plugin module imports this one only when a layer first
runs (listing plugins stays cheap, and `TRITON_INTERPRET=1` set before that first run takes effect).

Three steps per layer:

1. `align_block_size`: token-expert assignments sorted by expert, each expert's run padded to a
   multiple of BLOCK_M with a sentinel, so every BLOCK_M-row tile of the sorted list belongs to one
   expert. Plain torch with fixed-size outputs: no host sync, so the layer can be captured in a graph.
2. `_gate_up_act_kernel`: one grouped GEMM over the tiles, x rows gathered by assignment, both the
   gate and the up rows of the tile's expert, the activation and the gate*up product fused; writes
   one [I] row per assignment.
3. `_down_weight_kernel`: one grouped GEMM of those rows with the expert's down matrix, the routing
   weight multiplied in; writes one [H] row per assignment. The per-token sum runs in torch.

Rounding follows `grouped` (and so transformers) step for step: the gate/up and down products are
rounded to the activation dtype before the activation and before the routing weight, the weighted
term is rounded once more, and a token's terms are added in ascending expert order in the
activation dtype. Only the order of accumulation inside each matrix product differs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# activation name (FusedExperts' `activation`) -> the kernel's ACT code
ACT_CODES = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1, "gelu_new": 1, "gelu": 2}
_TORCH_TO_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes of both GEMMs. GROUP_M tiles along M share their N columns on the way through L2."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 2


def default_config(num_assignments: int, num_experts: int) -> TileConfig:
    """vLLM's untuned default: small M tiles when few assignments per expert (decode), larger otherwise."""
    if num_assignments <= num_experts:
        return TileConfig(16, 32, 64, 1)
    return TileConfig(64, 64, 32, 8)


def align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted assignment ids [P] padded with T*k, expert id per BLOCK_M tile [P / block_m] (-1 past
    the end), number of padded rows [1]), with P a fixed upper bound so nothing waits for the device.

    Assignment a = t * k + j is token t's j-th expert. Rows of expert e occupy
    [padded_start[e], padded_start[e] + count[e]) in ascending assignment order; the rest of its
    padded run holds the sentinel."""
    flat = topk_ids.reshape(-1)
    n = flat.numel()
    dev = flat.device
    # Each non-empty expert wastes fewer than block_m rows; at most min(E, n) are non-empty.
    max_padded = triton.cdiv(n + min(num_experts, n) * (block_m - 1), block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int64))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    dest = padded_start[experts] + torch.arange(n, device=dev) - start[experts]
    sorted_ids = torch.full((max_padded,), n, dtype=torch.int32, device=dev)
    sorted_ids[dest] = order.to(torch.int32)
    tile_rows = torch.arange(0, max_padded, block_m, device=dev)
    tile_expert = torch.searchsorted(padded_end, tile_rows, right=True)
    tile_expert = torch.where(tile_expert < num_experts, tile_expert, -1).to(torch.int32)
    return sorted_ids, tile_expert, padded_end[-1:].to(torch.int32)


@triton.jit
def _tile_coords(num_rows_padded, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(M tile, N tile) of this program, GROUP_M M-tiles walked together per N column band."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(num_rows_padded, BLOCK_M)
    num_pid_n = tl.cdiv(n_cols, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    return pid_m, pid_n


@triton.jit
def _gate_up_act_kernel(
    x_ptr, w_ptr, out_ptr, sorted_ids_ptr, tile_expert_ptr, num_padded_ptr,
    num_rows_padded, inter, hidden, num_valid, top_k,
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_om, stride_on,
    ACT: tl.constexpr, DTYPE: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """out[a, n] = act(x[a // k] . gate_e[n]) * (x[a // k] . up_e[n]) for the assignments a of
    this tile's expert e; w is gate_up_proj [E, 2I, H] (gate rows first)."""
    pid_m, pid_n = _tile_coords(num_rows_padded, inter, BLOCK_M, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    assignment = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)
    valid = assignment < num_valid
    token = assignment // top_k
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + token[:, None] * stride_xm + offs_k[None, :] * stride_xk
    g_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    u_ptrs = g_ptrs + inter * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(hidden, BLOCK_K)):
        k_ok = offs_k < hidden - k0 * BLOCK_K
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        g = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        u = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if IEEE:
            acc_g = tl.dot(a, g, acc_g, input_precision="ieee")
            acc_u = tl.dot(a, u, acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(a, g, acc_g)
            acc_u = tl.dot(a, u, acc_u)
        a_ptrs += BLOCK_K * stride_xk
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk
    # as torch: gate and up rounded to the activation dtype, act(gate) rounded, then the product
    gate = acc_g.to(DTYPE).to(tl.float32)
    up = acc_u.to(DTYPE).to(tl.float32)
    if ACT == 0:  # silu
        act = gate * tl.sigmoid(gate)
    elif ACT == 1:  # gelu, tanh approximation; tanh(z) = 2 sigmoid(2z) - 1
        z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = 0.5 * gate * (2.0 * tl.sigmoid(2.0 * z))
    else:  # gelu, exact
        act = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476))
    h = act.to(DTYPE).to(tl.float32) * up
    o_ptrs = out_ptr + assignment[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(o_ptrs, h.to(DTYPE), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _down_weight_kernel(
    h_ptr, w_ptr, out_ptr, weights_ptr, sorted_ids_ptr, tile_expert_ptr, num_padded_ptr,
    num_rows_padded, hidden, inter, num_valid,
    stride_hm, stride_hk, stride_we, stride_wn, stride_wk, stride_om, stride_on,
    DTYPE: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """out[a, n] = weight[a] * (h[a] . down_e[n]), the product rounded to the activation dtype
    before the weight multiply and after it; w is down_proj [E, H, I]."""
    pid_m, pid_n = _tile_coords(num_rows_padded, hidden, BLOCK_M, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    assignment = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)
    valid = assignment < num_valid
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + assignment[:, None] * stride_hm + offs_k[None, :] * stride_hk
    b_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(inter, BLOCK_K)):
        k_ok = offs_k < inter - k0 * BLOCK_K
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_hk
        b_ptrs += BLOCK_K * stride_wk
    weight = tl.load(weights_ptr + assignment, mask=valid, other=0.0).to(tl.float32)
    y = acc.to(DTYPE).to(tl.float32) * weight[:, None]
    o_ptrs = out_ptr + assignment[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(o_ptrs, y.to(DTYPE), mask=valid[:, None] & n_ok[None, :])


def _grid(rows_padded: int, cols: int, cfg: TileConfig) -> tuple[int]:
    return (triton.cdiv(rows_padded, cfg.block_m) * triton.cdiv(cols, cfg.block_n),)


def fused_moe(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: str, config: TileConfig | None = None) -> torch.Tensor:
    """[T, H] = sum over j of (topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])).to(x.dtype), the
    terms added in ascending expert order (the `MoeKernel` contract). fp32 runs the products at
    IEEE precision (no TF32), so fp32 results match torch's fp32 matmuls up to summation order."""
    if x.dtype not in _TORCH_TO_TL:
        raise TypeError(f"triton MoE kernel: dtype {x.dtype} not supported (float32, bfloat16, float16)")
    if activation not in ACT_CODES:
        raise ValueError(f"triton MoE kernel: activation {activation!r} not supported ({', '.join(ACT_CODES)})")
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = gate_up_proj.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    # a token's assignments in ascending expert order, so the final sum adds them in that order
    topk_ids, perm = torch.sort(topk_ids, dim=1)
    topk_weights = topk_weights.gather(1, perm).reshape(-1)
    if not topk_weights.is_contiguous():
        topk_weights = topk_weights.contiguous()
    n = num_tokens * top_k
    cfg = config or default_config(n, num_experts)
    sorted_ids, tile_expert, num_padded = align_block_size(topk_ids, num_experts, cfg.block_m)
    rows_padded = sorted_ids.numel()
    dtype, ieee = _TORCH_TO_TL[x.dtype], x.dtype == torch.float32
    tiles = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                 num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    h = torch.empty(n, inter, dtype=x.dtype, device=x.device)
    _gate_up_act_kernel[_grid(rows_padded, inter, cfg)](
        x, gate_up_proj, h, sorted_ids, tile_expert, num_padded,
        rows_padded, inter, hidden, n, top_k,
        x.stride(0), x.stride(1), gate_up_proj.stride(0), gate_up_proj.stride(1), gate_up_proj.stride(2),
        h.stride(0), h.stride(1),
        ACT=ACT_CODES[activation], DTYPE=dtype, IEEE=ieee, **tiles)
    terms = torch.empty(n, hidden, dtype=x.dtype, device=x.device)
    _down_weight_kernel[_grid(rows_padded, hidden, cfg)](
        h, down_proj, terms, topk_weights, sorted_ids, tile_expert, num_padded,
        rows_padded, hidden, inter, n,
        h.stride(0), h.stride(1), down_proj.stride(0), down_proj.stride(1), down_proj.stride(2),
        terms.stride(0), terms.stride(1),
        DTYPE=dtype, IEEE=ieee, **tiles)
    terms = terms.view(num_tokens, top_k, hidden)
    out = terms[:, 0].clone()
    for j in range(1, top_k):  # one rounding per addition, as index_add_ in grouped / transformers
        out += terms[:, j]
    return out
