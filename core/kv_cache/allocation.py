"""The KV cache's memory: each attention layer's cache tensor, in its backend's layout and the layer's cache
dtype, and how many pages a memory budget holds."""

from __future__ import annotations

import math
import mmap

import torch
from torch import nn

from fw.errors import ConfigError
from fw.layers.attention import Attention


def cache_dtype(layer: Attention, model_dtype: torch.dtype) -> torch.dtype:
    """The layer's --kv-cache-dtype as the loader bound it; the model dtype for layers built without it."""
    return getattr(layer, "kv_cache_dtype", None) or model_dtype


def attention_layers(model: nn.Module) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


def bytes_per_page(model: nn.Module, backend: type, page_size: int, dtype: torch.dtype) -> int:
    """Bytes one page costs over all layers, in the backend's own cache layout and each layer's cache dtype."""
    return sum(math.prod(backend.kv_cache_shape(1, page_size, m.num_kv_heads, m.head_dim))
               * cache_dtype(m, dtype).itemsize for m in attention_layers(model))


def allocate(layers: list[Attention], backend: type, num_pages: int, page_size: int, dtype: torch.dtype,
             device: torch.device) -> None:
    """Give every layer its `kv_cache`: on the CPU resident only as pages are written, elsewhere zeroed."""
    for layer in layers:
        shape = tuple(backend.kv_cache_shape(num_pages, page_size, layer.num_kv_heads, layer.head_dim))
        if device.type == "cpu":
            layer.kv_cache = zeros_touched_lazily(shape, cache_dtype(layer, dtype))
        else:
            layer.kv_cache = torch.zeros(shape, dtype=cache_dtype(layer, dtype), device=device)


def zeros_touched_lazily(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor whose pages are only backed by memory once written: an anonymous private mapping
    (the kernel's zero pages). Why: the KV cache is sized for the longest batch but a server mostly holds short
    ones; `torch.zeros` would make all of it resident at start (1 GiB by default) and the resident set would say
    nothing about what the model uses. It stays on 4 KiB pages (fw.engine.cpu_runtime says why)."""
    nbytes = max(1, math.prod(shape) * dtype.itemsize)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    tensor = torch.frombuffer(region, dtype=torch.uint8, count=nbytes)  # keeps `region` alive
    return tensor[: math.prod(shape) * dtype.itemsize].view(dtype).view(shape)


def pages_in_budget(budget: float, per_page: int, page_size: int, flag: str) -> int:
    """How many pages `budget` bytes hold; none is an error naming the flag that sets the budget."""
    if budget < per_page:
        raise ConfigError(
            f"no room for the KV cache: one page of {page_size} tokens needs {per_page} bytes but the budget is "
            f"{max(0, int(budget))} bytes; raise {flag} or use a smaller model/dtype")
    return int(budget // per_page)
