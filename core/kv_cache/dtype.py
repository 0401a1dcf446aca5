"""`--kv-cache-dtype`: which dtype each attention layer's KV cache is allocated in, and the per-layer
K/V scales an fp8 cache is quantized with.

An fp8 cache stores K / k_scale and V / v_scale (saturated to the format's finite range); attention
reads them back times the scale. The scales come from the checkpoint where it has them, under the names
quantization tools write: `layers.N.self_attn.k_scale` / `v_scale` (vLLM, llm-compressor, HF fp8),
`layers.N.self_attn.{k,v}_proj.output_scale` (older compressed-tensors) or one `kv_scale` for both
(AutoFP8); else 1.0, which suits models whose K/V stay well inside e4m3's +-448 range. Those tensors are
taken out of the weight stream, so a checkpoint that carries them loads whatever the cache dtype."""

from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch
from torch import nn

from fw.layers.attention import Attention

KV_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}

_SCALE_NAME = re.compile(r"layers\.(\d+)\..*?(?:(k|v)_scale|(k|v)_proj\.output_scale|(kv)_scale)$")


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's torch dtype for a --kv-cache-dtype value (auto: the model's)."""
    return model_dtype if name == "auto" else KV_TORCH_DTYPES[name]


def kv_cache_requirement(name: str, model_dtype: torch.dtype) -> str:
    """The value attention backends are asked to support: "auto" when the cache is in the model dtype
    anyway (so `--kv-cache-dtype bfloat16` on a bf16 model needs nothing special)."""
    return "auto" if resolve_kv_cache_dtype(name, model_dtype) == model_dtype else name


class KvScales:
    """Wraps a checkpoint's (name, tensor) stream: K/V scale tensors are kept here (layer index ->
    {"k": float, "v": float}) instead of reaching the model, which has no parameter for them."""

    def __init__(self) -> None:
        self.by_layer: dict[int, dict[str, float]] = {}

    def filter(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            m = _SCALE_NAME.search(name)
            if m is None:
                yield name, tensor
                continue
            which = m.group(2) or m.group(3) or m.group(4)
            value = float(tensor.float().reshape(-1).max())
            layer = self.by_layer.setdefault(int(m.group(1)), {})
            for key in ("k", "v") if which == "kv" else (which,):
                layer[key] = value


def bind_kv_cache(model: nn.Module, cache_dtype: torch.dtype, scales: KvScales) -> None:
    """Tell each attention layer (in model order: layer i is the i-th) its cache dtype and K/V scales;
    the model runner allocates the cache from `kv_cache_dtype`, the backend reads `k_scale`/`v_scale`."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    for index, layer in enumerate(layers):
        found = scales.by_layer.get(index, {})
        layer.kv_cache_dtype = cache_dtype
        layer.impl.k_scale = found.get("k", 1.0)
        layer.impl.v_scale = found.get("v", 1.0)
