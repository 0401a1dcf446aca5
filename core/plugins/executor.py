"""The executor contract: how the ranks other than 0 of a tensor-parallel engine come to exist
(vLLM's `--distributed-executor-backend`). An `executor` plugin (`fw.plugins.ExecutorSpec`)
implements `Executor`; fw's built-ins are `uni`, `mp` and `external_launcher`.

What an executor decides is where and how the worker processes start and how rank 0 watches
and stops them. What they do once started is fw's and the same under every executor: each runs
`WorkerLaunch.target` (fw's worker main), joins rank 0 at `WorkerLaunch.addr`, loads its shard and
steps as rank 0's broadcasts tell it (fw.distributed.worker), so a new executor cannot make the
ranks disagree. This module imports nothing heavy: `fw.plugins` re-exports it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, runtime_checkable

if TYPE_CHECKING:
    from fw.config import EngineConfig


@dataclass(frozen=True)
class WorkerLaunch:
    """The ranks an executor is asked to start. `target(*args(rank))` is a worker's whole life: run
    it in the new process (it is a module-level function, so it pickles for spawn, Ray and the like;
    it ends its process with os._exit). `ranks` are global ranks; `local_ranks` is how many ranks
    each node runs (rank r is local rank r % local_ranks, which picks its cores and GPU)."""

    config: EngineConfig
    addr: str  # HOST:PORT where rank 0 waits for the others
    ranks: tuple[int, ...]
    local_ranks: int
    target: Callable[..., None]

    def args(self, rank: int) -> tuple:
        """The arguments of `target` for global rank `rank`."""
        return (self.config, rank, self.addr, rank % self.local_ranks, self.local_ranks)


@runtime_checkable
class WorkerProcess(Protocol):
    """One started rank as rank 0 watches it; `multiprocessing.Process` is one. `sentinel` is a
    waitable (`multiprocessing.connection.wait`) that becomes ready when the rank ends, which is how
    rank 0 notices a dead worker at once; `exitcode` is None while it runs, negative for a signal."""

    pid: int | None
    exitcode: int | None
    sentinel: Any

    def is_alive(self) -> bool: ...

    def join(self, timeout: float | None = None) -> None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


class Executor(ABC):
    """Starts the other ranks of one engine. One instance per engine start (`ExecutorSpec.factory()`).

    fw calls, in this order: `prepare` (first thing in `fw serve` / `fw generate`, before any
    engine), then on rank 0 at --tensor-parallel-size > 1 `meeting_point` and `start_workers`; a
    machine started with --node-rank > 0 calls `start_workers` for its own ranks. Rank 0 then waits
    for every rank to join (--dist-init-timeout), drives them, and stops them with `WorkerProcess`'s
    join / terminate / kill."""

    def prepare(self, config: EngineConfig) -> EngineConfig:
        """The configuration this process runs with. An executor whose ranks are started by
        something else (a launcher) may read the layout from it here, and may turn this process into
        a worker and not return. The default: `config` unchanged."""
        return config

    def meeting_point(self, config: EngineConfig) -> tuple[Any, str] | None:
        """`(store, "HOST:PORT")`: a torch.distributed Store the ranks meet in, when the executor
        has one (a launcher's). None (the default): rank 0 serves one at --dist-init-addr."""
        return None

    @abstractmethod
    def start_workers(self, launch: WorkerLaunch) -> Mapping[int, WorkerProcess]:
        """Start `launch.ranks` (each running `launch.target(*launch.args(rank))`) and return them by
        rank, without waiting for them to join. Ranks this executor does not start itself (a launcher
        started them) are left out of the result. Raise `fw.errors.ConfigError` for a layout it cannot
        run, naming the flag."""


__all__ = ["Executor", "WorkerLaunch", "WorkerProcess"]
