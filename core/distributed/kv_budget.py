"""The KV page count of a tensor-parallel engine: every rank allocates the same pages (one page table
serves them all), so the count is the smallest that any rank's own budget holds. Each rank computes its
own (fw.kv_cache.allocation.page_budget: its KV heads, its --kv-cache-memory or its GPU's free memory) and
one MIN all-reduce tells every rank every rank's figures, so a rank whose budget holds no page is named,
with its numbers, by all of them at once (rank 0's error is the one the user sees)."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from fw.kv_cache.allocation import PageBudget

_FIELDS = 3  # pages, bytes per page, budget bytes
_UNSET = torch.iinfo(torch.long).max  # another rank's slots: the MIN keeps that rank's own figures


def agree_pages(group, rank: int, world: int, own: PageBudget, timeout: timedelta) -> int:
    """The page count every rank allocates: the minimum over the ranks of what each one's budget holds.
    `group` is the gloo group (a CPU tensor). Raises the ConfigError of the lowest rank whose budget holds
    no page, naming it; every rank raises it, so none waits for the others."""
    figures = torch.full((world, _FIELDS), _UNSET, dtype=torch.long)
    figures[rank] = torch.tensor([own.pages, own.per_page, own.budget], dtype=torch.long)
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MIN
    options.timeout = timeout
    group.allreduce([figures], options).wait()
    for other, (pages, per_page, budget) in enumerate(figures.tolist()):
        if pages < 1:
            raise PageBudget(pages, per_page, budget, own.page_size, own.flag).error(other)
    return int(figures[:, 0].min())
