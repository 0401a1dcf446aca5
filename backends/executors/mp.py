"""The built-in `mp` executor: this machine's ranks as worker processes started with
torch.multiprocessing's spawn method (vLLM's `mp`). Auto's choice at --tensor-parallel-size > 1;
with --nnodes every machine runs fw and spawns its own ranks."""

from __future__ import annotations

from typing import Mapping

import torch.multiprocessing as mp

from fw.plugins import Executor, ExecutorSpec, WorkerLaunch, WorkerProcess, hookimpl

FW_PLUGIN_API_VERSION = "1.10"


class MultiprocessExecutor(Executor):
    def start_workers(self, launch: WorkerLaunch) -> Mapping[int, WorkerProcess]:
        """Spawned, not forked (a fork would copy the parent's threads and CUDA state). Daemons: they are
        terminated if this process exits without stopping them."""
        context = mp.get_context("spawn")
        procs = {}
        for rank in launch.ranks:
            proc = context.Process(target=launch.target, args=launch.args(rank), name=f"fw-tp-rank{rank}",
                                   daemon=True)
            proc.start()
            procs[rank] = proc
        return procs


@hookimpl
def fw_register_executors(register) -> None:
    register(ExecutorSpec("mp", MultiprocessExecutor, multi_node=True,
                          description="worker processes spawned on this machine (each --nnodes machine its own)"))
