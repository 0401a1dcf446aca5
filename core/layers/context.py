"""What an architecture's `build` receives besides the HF config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from fw.layers.linear import UnquantizedLinearMethod


@dataclass
class ModelContext:
    """Build-time choices: dtype, device, attention backend class, linear method.

    `linear_method_for(prefix)` lets a quantization method leave some layers
    (say, the LM head) unquantized."""

    dtype: torch.dtype
    device: torch.device
    attention_backend: type
    linear_method: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    def linear_method_for(self, prefix: str):
        method = self.linear_method
        if method is None:
            return UnquantizedLinearMethod()
        chooser = getattr(method, "method_for", None)
        return chooser(prefix) if chooser is not None else method
