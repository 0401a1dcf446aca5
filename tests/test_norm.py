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
