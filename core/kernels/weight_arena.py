"""Weights that stream from memory every step, side by side in 2 MiB-aligned chunks backed by transparent
huge pages (fw.kernels.packed_int and fw.kernels.dense put their packed weights here on the CPU).

Why: a decode step reads every weight once, in pieces of 0.2-2 MB. On 4 KiB pages the hardware prefetcher
stops at every page boundary and each page costs a TLB walk; on huge pages the packed-int products and
batch-1 decode on both the packed-int and the dense bf16 paths are faster (docs/performance.md). A chunk is freed when no weight views it any more; the alignment
slack is never written, so it costs address space, not memory.
"""

from __future__ import annotations

import torch

CHUNK = 16 << 20  # bytes per chunk (a larger weight gets a chunk of its own size)
ALIGN = 64  # each weight starts on a cache line
HUGE_PAGE = 2 << 20


class HugePageArena:
    """A bump allocator over huge-page chunks."""

    def __init__(self) -> None:
        self._chunk: torch.Tensor | None = None
        self._used = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """A fresh uint8 tensor of `nbytes` (not yet written), from the current chunk or a new one."""
        from fw.engine.cpu_runtime import advise_huge_pages  # lazy: fw.engine imports fw.layers

        start = -(-self._used // ALIGN) * ALIGN
        if self._chunk is None or start + nbytes > self._chunk.numel():
            size = max(CHUNK, nbytes)
            raw = torch.empty(size + HUGE_PAGE, dtype=torch.uint8)  # room to start on a huge-page boundary
            begin = -raw.data_ptr() % HUGE_PAGE
            self._chunk = raw[begin:begin + size]
            advise_huge_pages(self._chunk)  # before the first write
            start = 0
        self._used = start + nbytes
        return self._chunk[start:start + nbytes]


_ARENA = HugePageArena()  # one per process: the weights a load packs land next to each other


def take(nbytes: int) -> torch.Tensor:
    return _ARENA.take(nbytes)


def holding(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of a contiguous CPU tensor in the arena (same dtype and shape)."""
    out = take(tensor.numel() * tensor.element_size()).view(tensor.dtype).view(tensor.shape)
    out.copy_(tensor)
    return out
