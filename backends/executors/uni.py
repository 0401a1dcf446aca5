"""The built-in `uni` executor: one process, no other rank (vLLM's `uni`). Auto's choice at
--tensor-parallel-size 1, where the engine starts nothing."""

from __future__ import annotations

from typing import Mapping

from fw.errors import ConfigError
from fw.plugins import Executor, ExecutorSpec, WorkerLaunch, WorkerProcess, hookimpl

FW_PLUGIN_API_VERSION = "1.10"


class UniExecutor(Executor):
    def start_workers(self, launch: WorkerLaunch) -> Mapping[int, WorkerProcess]:
        if launch.ranks:
            raise ConfigError(f"--distributed-executor-backend uni runs one process and cannot start ranks "
                              f"{', '.join(map(str, launch.ranks))}; use mp (or --tensor-parallel-size 1)")
        return {}


@hookimpl
def fw_register_executors(register) -> None:
    register(ExecutorSpec("uni", UniExecutor, max_world_size=1,
                          description="one process: the engine and the whole model in this process"))
