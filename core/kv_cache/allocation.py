"""The KV cache's memory: each attention layer's cache tensor, in its backend's layout and the layer's cache
dtype, and how many pages a memory budget holds."""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch
from torch import nn

from fw.config import parse_size
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


@dataclass(frozen=True)
class PageBudget:
    """What one rank's memory budget holds: `pages` (0 when not even one fits), the bytes one page costs on
    this rank, the budget in bytes, and the flag that sets it. Plain integers, so the ranks of a
    tensor-parallel engine can exchange them (fw.distributed.kv_budget)."""

    pages: int
    per_page: int
    budget: int
    page_size: int
    flag: str

    def error(self, rank: int | None = None) -> ConfigError:
        where = "" if rank is None else f"rank {rank}: "
        return ConfigError(
            f"{where}no room for the KV cache: one page of {self.page_size} tokens needs {self.per_page} bytes but "
            f"the budget is {self.budget} bytes; raise {self.flag} or use a smaller model/dtype")

    def require(self) -> int:
        """The page count; a budget that holds no page is an error naming the flag that sets it."""
        if self.pages < 1:
            raise self.error()
        return self.pages


def page_budget(config, loaded, page_size: int) -> PageBudget:
    """How many pages this process's budget holds for `loaded` (its own shard: its KV heads, its dtype, its
    device): --num-kv-blocks when given; else --kv-cache-memory off CUDA; on CUDA the device's memory times
    --device-memory-utilization, minus what is in use (weights) and room for one step's activations.
    Rank 0 and the tensor-parallel workers both call it; the ranks then agree on the smallest."""
    per_page = bytes_per_page(loaded.model, loaded.attention.chosen.backend_cls, page_size, loaded.dtype)
    if config.num_kv_blocks:
        return PageBudget(config.num_kv_blocks, per_page, config.num_kv_blocks * per_page, page_size,
                          "--num-kv-blocks")
    if loaded.device.type != "cuda":
        budget, flag = parse_size(config.kv_cache_memory), "--kv-cache-memory"
    else:
        free, total = torch.cuda.mem_get_info(loaded.device)
        budget = total * config.device_memory_utilization - (total - free) - activation_reserve(config, loaded)
        flag = "--device-memory-utilization"
    budget = max(0, int(budget))
    return PageBudget(budget // per_page, per_page, budget, page_size, flag)


def activation_reserve(config, loaded) -> int:
    """A generous bound on one step's temporaries: hidden/MLP activations and sampled logits."""
    cfg, size = loaded.model_config, torch.tensor([], dtype=loaded.dtype).element_size()
    inter = cfg.intermediate_size or 4 * cfg.hidden_size
    return (config.step_tokens * (6 * cfg.hidden_size + 3 * inter) * size
            + config.max_batch_size * cfg.vocab_size * 12)
