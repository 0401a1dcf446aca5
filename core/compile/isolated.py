"""torch.compile with graphs and a recompile budget of their own, on every torch fw supports.

Two engines in one process (a test suite, a server beside a bench) compile the same code objects;
with one shared budget the later configurations ran out of recompiles and fell back to eager
without saying so. torch 2.13 isolates them per compile call (`isolate_recompiles`); older
releases (2.11 on the GPU machine) have only the process-wide limit, so it is raised instead."""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

SHARED_RECOMPILE_LIMIT = 64  # the process-wide limit where torch cannot isolate: room for many configurations


def compile_isolated(fn: Callable[..., Any], recompile_limit: int | None = None, **options: Any) -> Callable[..., Any]:
    """torch.compile(fn, **options), isolated where torch can do it, else under a raised shared limit."""
    if "isolate_recompiles" in inspect.signature(torch.compile).parameters:
        if recompile_limit is not None:
            options["recompile_limit"] = recompile_limit
        return torch.compile(fn, isolate_recompiles=True, **options)
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), recompile_limit or 0, SHARED_RECOMPILE_LIMIT))
    return torch.compile(fn, **options)
