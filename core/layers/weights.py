"""Loading named checkpoint tensors into a model's parameters."""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from fw.errors import ModelLoadError


def default_weight_loader(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if param.shape != tensor.shape:
        raise ModelLoadError(f"weight {name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(param.shape)}")
    param.data.copy_(tensor)


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    fused: dict[str, tuple[str, int]] | None = None,
    skip: tuple[str, ...] = (),
) -> set[str]:
    """Load (name, tensor) pairs; `fused` maps a checkpoint sub-name (".q_proj.") to
    (fused sub-name, shard), e.g. {".q_proj.": (".qkv_proj.", 0)}.

    Returns the set of model parameter names loaded; raises on a name the model
    does not have, so a mis-mapped checkpoint fails loudly."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    loaded: set[str] = set()
    for name, tensor in weights:
        if any(s in name for s in skip):
            continue
        shard = None
        for sub, (fused_sub, index) in (fused or {}).items():
            if sub in name:
                name, shard = name.replace(sub, fused_sub), index
                break
        module_name, _, param_name = name.rpartition(".")
        module = modules.get(module_name)
        if name not in params or module is None:
            raise ModelLoadError(f"checkpoint tensor {name!r} has no matching parameter in the model")
        if hasattr(module, "load_weight"):
            module.load_weight(param_name, tensor, shard)
        else:
            default_weight_loader(params[name], tensor.to(params[name].dtype), name)
        loaded.add(name)
    for module in model.modules():
        method = getattr(module, "method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)
    return loaded


def unpermute_gguf_qk(name: str, tensor: torch.Tensor, cfg) -> torch.Tensor:
    """Undo llama.cpp's `normal` rope layout of q/k rows (interleaved pairs) into Hugging Face's
    rotate-half order; other tensors pass through. A GGUF weight transform (ArchitectureSpec)."""
    if name.endswith("q_proj.weight"):
        heads = cfg.num_attention_heads
    elif name.endswith("k_proj.weight"):
        heads = cfg.num_key_value_heads
    else:
        return tensor
    rows = tensor.shape[0]
    return tensor.reshape(heads, rows // heads // 2, 2, *tensor.shape[1:]).transpose(1, 2).reshape(tensor.shape)
