"""What a model's attention layers need from the backend (sliding window, logit soft-capping),
read from its Hugging Face config before the model is built, and checked against the built
layers afterwards.

Windows can be per layer (Gemma 2/3 interleave sliding and global layers, Qwen2 slides
only from `max_window_layers` on): the model needs a window if some layer slides. transformers
5 states that as `layer_types`; an older config without it slides in every layer when it
names a window (Mistral), unless `use_sliding_window` is false (Qwen2/3)."""

from __future__ import annotations

from typing import Any

from torch import nn

from fw.errors import UnsupportedConfigurationError
from fw.layers.attention import Attention
from fw.model.config import as_model_config


def sliding_window_needed(hf_config: Any) -> int | None:
    """The config's window if at least one layer uses it, else None."""
    cfg = as_model_config(hf_config)
    if not cfg.sliding_window or cfg.use_sliding_window is False:
        return None
    if cfg.layer_types is not None and "sliding_attention" not in cfg.layer_types:
        return None
    return cfg.sliding_window


def logit_softcap_needed(hf_config: Any) -> float | None:
    """Attention-logit soft-capping (Gemma 2's `attn_logit_softcapping`)."""
    return as_model_config(hf_config).attn_logit_softcapping


def check_built_layers(model: nn.Module, backend_spec: Any) -> None:
    """The layers the architecture built ask nothing of the backend that the config did not
    announce (the backend was chosen from the config): a safety net against silently
    ignoring a window or a cap."""
    missing = set()
    for layer in model.modules():
        if not isinstance(layer, Attention):
            continue
        if layer.impl.sliding_window is not None and not backend_spec.supports_sliding_window:
            missing.add("sliding-window attention")
        if layer.impl.logit_softcap is not None and not backend_spec.supports_logit_softcap:
            missing.add("attention logit soft-capping")
    if missing:
        raise UnsupportedConfigurationError(
            f"the model's attention layers use {' and '.join(sorted(missing))}, which attention backend "
            f"{backend_spec.name!r} does not support; pass --attention-backend sdpa."
        )
