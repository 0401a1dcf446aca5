"""Which checkpoints a built model can take quantized, checked before any tensor is read.

Quantization methods reach only `fw.layers.Linear` layers. The architecture's own
`supported_quantization` can narrow the methods (None: all); and weights kept outside
`Linear` (the stacked experts of `fw.layers.FusedExperts`) can only load as float
tensors. A pre-quantized checkpoint that ships those experts quantized would otherwise
fail on the first expert tensor with a bare "no matching parameter", or, for a format
that keeps the name `weight` (fp8), load fp8 codes without their scales."""

from __future__ import annotations

import logging
from pathlib import Path

from torch import nn

from fw.errors import UnsupportedConfigurationError
from fw.layers.moe import FusedExperts
from fw.plugins.specs import ArchitectureSpec

logger = logging.getLogger("fw.loader")


def check_method_supported(arch: ArchitectureSpec, name: str) -> None:
    """`arch.supported_quantization`: None accepts every method; a tuple only those it names."""
    accepted = arch.supported_quantization
    if accepted is None or name in accepted:
        return
    raise UnsupportedConfigurationError(
        f"architecture {arch.name} does not support quantization {name!r}; "
        + (f"it supports {', '.join(accepted)}" if accepted else "it takes no quantization method")
        + ". Drop --quantization, or use an unquantized checkpoint")


def warn_dense_experts(model: nn.Module, method: str) -> bool:
    """Log one warning when a model quantized with `method` has MoE experts: they stay dense (in the model
    dtype), so most of a MoE model's weight bytes are not quantized. Returns whether it warned."""
    layers = [m for m in model.modules() if isinstance(m, FusedExperts)]
    if not layers:
        return False
    dtype = str(layers[0].gate_up_proj.dtype).removeprefix("torch.")
    size = sum(p.numel() * p.element_size() for m in layers for p in (m.gate_up_proj, m.down_proj))
    logger.warning("quantization %s: the MoE experts of %d layers stay dense in %s (%.2f GB); %s quantizes "
                   "the linear layers only (fw has no quantized expert kernel yet)",
                   method, len(layers), dtype, size / 1e9, method)
    return True


def check_expert_tensors(model: nn.Module, checkpoint: Path, method: str, arch_name: str) -> None:
    """Refuse a quantized checkpoint whose MoE expert tensors are quantized (any expert tensor other than
    a plain per-expert `weight` or the stacked parameters themselves). Reads only the file headers, and
    only for models that have experts."""
    experts = {name.rpartition(".")[2]: module for name, module in model.named_modules()
               if isinstance(module, FusedExperts)}
    if not experts:
        return
    plain = {"weight"} | {p for m in experts.values() for p, _ in m.named_parameters(recurse=False)}
    for tensor in safetensors_names(checkpoint):
        parts = tensor.split(".")
        if not any(component in experts for component in parts[:-1]) or parts[-1] in plain:
            continue
        raise UnsupportedConfigurationError(
            f"this checkpoint is quantized ({method}) including its MoE experts (tensor {tensor!r}), but "
            f"{arch_name} keeps the experts as stacked tensors outside fw.layers.Linear, which quantization "
            f"methods do not reach, so fw cannot load them. Use a checkpoint whose experts are unquantized "
            f"(its attention and dense layers may stay quantized), or an unquantized checkpoint with "
            f"--quantization NAME to quantize the linear layers on load")


def safetensors_names(path: Path) -> list[str]:
    """Tensor names of a checkpoint directory, from the file headers (no tensor is read)."""
    from safetensors import SafetensorError, safe_open  # here: only a checkpoint's scales need it

    from fw.model.hf import safetensors_files  # here: fw.model.hf imports transformers' config classes

    names: list[str] = []
    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                names.extend(f.keys())
        except (SafetensorError, OSError):
            continue  # reported with its file name when the weights are read
    return names
