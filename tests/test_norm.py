"""RMSNorm (computed as layer norm of [x, -x] for speed) against transformers' LlamaRMSNorm."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from fw.layers import RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_transformers(dtype):
    torch.manual_seed(0)
    ours, theirs = RMSNorm(576, 1e-5, dtype), LlamaRMSNorm(576, eps=1e-5).to(dtype)
    weight = torch.randn(576, dtype=dtype)
    ours.weight.data.copy_(weight)
    theirs.weight.data.copy_(weight)
    x, residual = torch.randn(33, 576, dtype=dtype) * 3, torch.randn(33, 576, dtype=dtype)
    out, new_residual = ours(x, residual.clone())  # the fused CPU path writes the sum into its argument
    assert torch.equal(new_residual, x + residual)
    want = theirs(x + residual)
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    else:  # the normalised value may round to the neighbouring bf16 in a few places
        assert (out != want).float().mean() < 0.01
        torch.testing.assert_close(out, want, atol=0.07, rtol=1.6e-2)
    torch.testing.assert_close(ours(x), theirs(x), atol=1e-5 if dtype == torch.float32 else 0.07,
                               rtol=1e-5 if dtype == torch.float32 else 1.6e-2)


@pytest.mark.parametrize("fused", [True, False])
def test_rounding_order_is_an_option_with_bf16_parity(fused):
    """OLMo 2 scales in fp32 and rounds once; Llama rounds, then scales in bf16. Each `rounding` matches
    its family in bf16 (the normalisation itself may differ in the last place in a few outputs) and
    not the other's; the fused CPU path takes only the order its kernel computes."""
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    torch.manual_seed(1)
    weight = (1 + torch.randn(256) * 0.5).to(torch.bfloat16)
    x = (torch.randn(64, 256) * 3).to(torch.bfloat16)
    families = {"round_then_scale": LlamaRMSNorm(256, eps=1e-6), "scale_then_round": Olmo2RMSNorm(256, eps=1e-6)}
    want = {}
    for rounding, theirs in families.items():
        theirs = theirs.to(torch.bfloat16)
        theirs.weight.data.copy_(weight)
        want[rounding] = theirs(x)
    assert (want["round_then_scale"] != want["scale_then_round"]).float().mean() > 0.1  # the orders differ
    for rounding, other in (("round_then_scale", "scale_then_round"), ("scale_then_round", "round_then_scale")):
        ours = RMSNorm(256, 1e-6, torch.bfloat16, rounding=rounding)
        ours.weight.data.copy_(weight)
        if not fused:
            ours.fused_ok = False
        assert ours.fused_ok == (fused and rounding == "round_then_scale")
        out = ours(x)
        assert (out != want[rounding]).float().mean() < 0.01, rounding
        assert (out != want[other]).float().mean() > 0.1, rounding
    assert RMSNorm(8, 1e-6, torch.bfloat16, weight_offset=1.0).rounding == "scale_then_round"  # Gemma's default
    with pytest.raises(ValueError, match="RMSNorm rounding 'fp32' is not one of round_then_scale, scale_then_round"):
        RMSNorm(8, 1e-6, torch.bfloat16, rounding="fp32")
