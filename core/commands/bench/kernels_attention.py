"""Decode-attention cases for `fw bench kernels --kind attention`.

Each case is what one attention layer does in one engine decode step: B sequences of `context`
tokens, one new query token each, K/V in the paged cache of the backend's own layout
(`kv_cache_shape`), pages scattered over the cache (a random permutation, as after the block
manager has recycled pages), metadata built the way fw.engine.model_runner builds it and the
backend's per-step `prepare` run once outside the timing, as the engine runs it once for all layers.

Traffic model (bytes): the K and V of every context token (the dominant term), the query and the
output, and the new token's K/V written; FLOPs: 2 (QK^T) + 2 (PV) per query head, key and dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import torch

from fw.commands.bench.kernels_case import KernelCase
from fw.devices import cuda_capability
from fw.layers.attention import AttentionMetadata
from fw.plugins.specs import AttentionRequirements


@dataclass(frozen=True)
class AttentionShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int


def requirements(device: torch.device, dtype: torch.dtype, shape: AttentionShape) -> AttentionRequirements:
    return AttentionRequirements(device=device.type, dtype=str(dtype).removeprefix("torch."),
                                 head_size=shape.head_dim, page_size=shape.page_size,
                                 capability=cuda_capability(device))


def decode_metadata(batch: int, context: int, page_size: int, num_blocks: int, device: torch.device,
                    gen: torch.Generator) -> AttentionMetadata:
    """B decodes whose new token is at position context - 1, on shuffled pages."""
    blocks_per_seq = math.ceil(context / page_size)
    pages = torch.randperm(num_blocks, generator=gen)[: batch * blocks_per_seq].view(batch, blocks_per_seq)
    last = context - 1
    slots = pages[:, last // page_size] * page_size + last % page_size
    return AttentionMetadata(
        num_decodes=batch, query_lens=[1] * batch, seq_lens=[context] * batch,
        query_start_loc=torch.arange(batch + 1, dtype=torch.long, device=device),
        seq_lens_tensor=torch.full((batch,), context, dtype=torch.long, device=device),
        block_tables=pages.to(device), slot_mapping=slots.to(device), page_size=page_size)


def traffic(batch: int, context: int, shape: AttentionShape, itemsize: int) -> tuple[int, int]:
    """(bytes moved, FLOPs) of one decode step of one layer."""
    kv = 2 * batch * context * shape.num_kv_heads * shape.head_dim * itemsize
    q_out = 2 * batch * shape.num_heads * shape.head_dim * itemsize
    new_kv = 2 * batch * shape.num_kv_heads * shape.head_dim * itemsize
    flops = 4 * batch * shape.num_heads * context * shape.head_dim
    return kv + q_out + new_kv, flops


def attention_cases(spec, device: torch.device, dtype: torch.dtype, shape: AttentionShape,
                    batch_sizes: list[int], context_lens: list[int], free_bytes: int | None,
                    seed: int) -> Iterator[KernelCase]:
    """One case per (batch, context) for a backend that can run; tensors live only while the case is timed."""
    backend_cls = spec.backend_cls
    itemsize = torch.empty((), dtype=dtype).element_size()
    for context in context_lens:
        for batch in batch_sizes:
            labels = {"batch": batch, "context": context}
            nbytes, flops = traffic(batch, context, shape, itemsize)
            num_blocks = batch * math.ceil(context / shape.page_size) + 1
            cache_shape = backend_cls.kv_cache_shape(num_blocks, shape.page_size, shape.num_kv_heads,
                                                     shape.head_dim)
            cache_bytes = math.prod(cache_shape) * itemsize
            if free_bytes is not None and cache_bytes > 0.85 * free_bytes:
                yield KernelCase(spec.name, labels, nbytes, flops, skipped=(
                    f"needs {cache_bytes / 2**30:.1f} GiB of KV cache, {free_bytes / 2**30:.1f} GiB free"))
                continue
            gen = torch.Generator().manual_seed(seed + batch * 7919 + context)
            kv_cache = torch.randn(cache_shape, dtype=dtype, device=device)
            meta = decode_metadata(batch, context, shape.page_size, num_blocks, device, gen)
            meta.backend_state = backend_cls.prepare(meta)
            impl = backend_cls(shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.head_dim ** -0.5)
            q = torch.randn(batch, shape.num_heads, shape.head_dim, dtype=dtype, device=device)
            k = torch.randn(batch, shape.num_kv_heads, shape.head_dim, dtype=dtype, device=device)
            v = torch.randn_like(k)

            def run(impl=impl, q=q, k=k, v=v, kv_cache=kv_cache, meta=meta) -> None:
                impl.forward(q, k, v, kv_cache, meta)

            yield KernelCase(spec.name, labels, nbytes, flops, run=run)
            del kv_cache, meta, impl, q, k, v, run
