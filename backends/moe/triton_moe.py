"""`triton`: a fused MoE kernel in Triton for CUDA, in the style of vLLM/SGLang's fused_moe.

Assignments are sorted by expert and padded per expert to the GEMM's row tile, then one grouped
GEMM computes gate/up with the activation fused and one computes down with the routing weight
multiplied in (fw.backends.moe.triton_moe_kernels). Against `grouped` it saves the per-expert
loop, its host sync and the gathered copy of x; it matches `grouped`'s rounding step for step.

Ranked below `grouped` (priority -10) until its tiles are tuned (docs/moe-kernels.md). float32 runs
at IEEE precision, not TF32, so an fp32 model gives the same tokens as the torch reference. The
kernels run on CPU only under Triton's interpreter (TRITON_INTERPRET=1), which the tests use; the
spec therefore declares CUDA only."""

from __future__ import annotations

import importlib.util

import torch

from fw.layers import FusedExperts, MoeKernel
from fw.plugins import MoeKernelSpec, Verified, hookimpl

FW_PLUGIN_API_VERSION = "1.2"  # dtype_min_capability, verified_on

ACTIVATIONS = ("silu", "swish", "gelu_pytorch_tanh", "gelu_new", "gelu")


def unavailable_reason() -> str | None:
    """Why the kernel cannot run in this process, or None."""
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed (pip install triton; it ships with CUDA builds of torch)"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    return None


class TritonMoeKernel(MoeKernel):
    def forward(self, experts: FusedExperts, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        from fw.backends.moe.triton_moe_kernels import fused_moe  # imports triton on first use

        if x.shape[0] == 0:
            return torch.empty_like(x)
        return fused_moe(x, experts.gate_up_proj, experts.down_proj, topk_weights, topk_ids, experts.activation)


@hookimpl
def fw_register_moe_kernels(register) -> None:
    register(MoeKernelSpec(
        name="triton",
        kernel_cls=TritonMoeKernel,
        devices=("cuda",),
        dtypes=("bfloat16", "float16", "float32"),
        activations=ACTIVATIONS,
        # Below `grouped` until its tiles are tuned: on an H200 (docs/moe-kernels.md) it was 1.0-2.0x slower
        # than `grouped` on a Mixtral-8x7B layer at every token count. `--moe-backend triton` still names it.
        priority=-10,
        available=unavailable_reason,
        dtype_min_capability={"bfloat16": (8, 0)},  # Triton's bf16 tl.dot
        # tests/test_triton_moe.py -m gpu; on CPU it runs only under the interpreter (a test tool)
        verified_on=(Verified("cuda", (9, 0), "NVIDIA H200", "2026-11-25", "scripts/gpu_acceptance.sh"),),
        description="Triton fused MoE (vLLM-style): expert-sorted, block-padded grouped GEMMs with the "
                    "activation and routing weight fused",
    ))
