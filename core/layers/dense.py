"""Dense (unquantized) matrix products, with the weight in the fastest layout the device has.

Why: on AVX-512 CPUs torch's `F.linear` reaches about 20 GB/s on bf16
matrix-vector products, which caps batch-1 decode. The same weight reordered
once into oneDNN's blocked layout (what inductor's freezing pass does) runs
1.6-1.8x faster at batch 1 and up to 2.5x faster in fp32 at batch 64; results
differ from F.linear's only by rounding (see docs/performance.md). Other devices keep the plain
weight. `FW_CPU_WEIGHT_PACKING=0` turns the packing off, to compare or to rule
it out when chasing a numerical difference.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)

# oneDNN's linear on a packed weight, as the resolved overload (the op packet resolves it on every call)
_linear_pointwise = getattr(getattr(torch.ops.mkldnn, "_linear_pointwise", None), "default", None)


def cpu_packing_available() -> bool:
    """oneDNN is built in and exposes the reorder/linear pair inductor uses."""
    if os.environ.get("FW_CPU_WEIGHT_PACKING", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    mkldnn = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
            and hasattr(mkldnn, "_linear_pointwise"))


def pack_dense_weight(weight: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """The weight [out, in] in the layout `dense_linear` runs fastest with on `device`, where the model
    will run (weights load on the CPU first); the input itself where packing does not apply (another
    device, another dtype, packing off). A packed weight cannot move off the CPU."""
    if torch.device(device).type != "cpu" or weight.device.type != "cpu":
        return weight
    if weight.dtype not in _PACKABLE_DTYPES or weight.dim() != 2:
        return weight
    if not cpu_packing_available():
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ weight^T (+ bias), for a weight from `pack_dense_weight` (packed or plain)."""
    if not weight.is_mkldnn:
        return F.linear(x, weight, bias)
    if x.dim() == 2 and x.is_contiguous() and x.dtype == weight.dtype:  # the hot path: one op
        return _linear_pointwise(x, weight, bias, "none", [], "")
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if flat.dtype != weight.dtype:
        raise TypeError(f"dense_linear: input dtype {flat.dtype} != weight dtype {weight.dtype}")
    out = _linear_pointwise(flat, weight, bias, "none", [], "")
    return out.view(*lead, out.shape[-1])
