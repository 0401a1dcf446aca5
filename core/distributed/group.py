"""One rank's view of its tensor-parallel group: its rank, the group size, and the collectives the
layers need (an all-reduce after each row-parallel projection).

Why a class of fw's own rather than torch.distributed's default group: the group lives in the
engine that made it, not in process-global state, so a process can hold engines of several
sizes one after the other (tests do) and a failed collective can be reported by the engine's own
rules (which rank died, what to check) instead of as gloo's socket error."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from fw.errors import DistributedError

# ModelContext.extra key under which the loader hands the group to the layers
CONTEXT_KEY = "tensor_parallel"


@dataclass
class TensorParallel:
    """rank in 0..size-1. `group` is a torch ProcessGroup (gloo on CPU, NCCL on CUDA) whose
    collectives run on the model's device; None when size is 1. `on_failure` turns a collective's
    exception into the error to raise (fw.distributed.cluster names the rank that died)."""

    rank: int = 0
    size: int = 1
    group: Any = None
    on_failure: Callable[[BaseException], BaseException] | None = None
    # ranks on one machine's CPU: the shared-memory all-reduce (fw.distributed.shm) instead of `group`,
    # and what its wait calls every millisecond (rank 0: raises when a worker died)
    local: Any = None
    check: Callable[[], None] | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group in place and return it. Every rank gets the same bits."""
        if self.size == 1:
            return x
        try:
            if self.local is None:
                self.group.allreduce([x]).wait()
            elif x.is_contiguous():
                self.local.all_reduce(x, self.check)
            else:
                x.copy_(self.local.all_reduce(x.contiguous(), self.check))
        except DistributedError:
            raise
        except Exception as exc:  # gloo/NCCL raise RuntimeError subclasses with socket-level text
            raise (self.on_failure(exc) if self.on_failure is not None else exc) from exc
        return x


SINGLE = TensorParallel()


def tensor_parallel_of(ctx) -> TensorParallel:
    """The group a model is built for: the loader's, or a single rank when it set none (a model
    built by hand, the conformance kit)."""
    return ctx.extra.get(CONTEXT_KEY, SINGLE)
