"""`grouped`: the reference MoE kernel, in plain torch on any device.

Token-expert assignments are sorted by expert, so each expert's tokens form one contiguous
slice; each active expert then runs one gate/up and one down matmul over its slice (a loop over
experts, never over tokens), and the weighted results are added back to their tokens. The work
is the same as a dense MLP over T*k rows, with at most two matmuls per expert per layer and one
host sync (the per-expert counts)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fw.layers import FusedExperts, MoeKernel
from fw.plugins import MoeKernelSpec, Verified, hookimpl

FW_PLUGIN_API_VERSION = "1.2"  # verified_on


class GroupedMoeKernel(MoeKernel):
    def forward(self, experts: FusedExperts, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        top_k = topk_ids.shape[1]
        flat_ids = topk_ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)  # assignments grouped by expert, in token order
        counts = torch.bincount(flat_ids, minlength=experts.num_experts).tolist()
        tokens = order // top_k  # the token each sorted assignment came from
        xs = x.index_select(0, tokens)
        ys = torch.empty_like(xs)
        inter = experts.intermediate_size
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = slice(start, start + n)
            gate_up = F.linear(xs[rows], experts.gate_up_proj[e])
            ys[rows] = F.linear(experts.act_fn(gate_up[:, :inter]) * gate_up[:, inter:], experts.down_proj[e])
            start += n
        # As transformers: weight in the promoted dtype (float32 for Mixtral's router), cast each
        # term to the activation dtype, then sum a token's terms in ascending expert order.
        weighted = (ys * topk_weights.reshape(-1)[order].unsqueeze(-1)).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, tokens, weighted)


@hookimpl
def fw_register_moe_kernels(register) -> None:
    register(MoeKernelSpec(
        name="grouped",
        kernel_cls=GroupedMoeKernel,
        priority=0,
        # on CUDA: tests/test_triton_moe.py -m gpu compares the triton kernel against it
        verified_on=(Verified("cpu", by="fw's CPU tests"),
                     Verified("cuda", (9, 0), "NVIDIA H200", "2026-11-25", "scripts/gpu_acceptance.sh")),
        description="torch reference: assignments sorted by expert, one matmul pair per active expert",
    ))
