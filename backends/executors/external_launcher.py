"""The built-in `external_launcher` executor: the ranks are processes a launcher started (torchrun,
or anything that sets torch's env:// variables), every one running the same fw command (vLLM's
`external_launcher`). Auto's choice when those variables are set. fw spawns nothing: rank 0 runs
the engine, every other rank becomes a worker in its own process (fw.distributed.launch)."""

from __future__ import annotations

from typing import Any, Mapping

from fw.config import EngineConfig
from fw.distributed import launch
from fw.errors import ConfigError
from fw.plugins import Executor, ExecutorSpec, WorkerLaunch, WorkerProcess, hookimpl

FW_PLUGIN_API_VERSION = "1.10"


def _launched() -> launch.Launched:
    launched = launch.from_env()
    if launched is None:
        raise ConfigError("--distributed-executor-backend external_launcher: no launcher started this process "
                          "(RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are not all set, or WORLD_SIZE is 1); "
                          "start it with torchrun, or use mp")
    return launched


class ExternalLauncherExecutor(Executor):
    def prepare(self, config: EngineConfig) -> EngineConfig:
        """The launcher's layout; a rank other than 0 becomes a worker here and does not return."""
        if launch.from_env() is None:
            if config.tensor_parallel_size == 1:
                return config  # one process and no launcher: nothing to start
            _launched()  # raises: the ranks would never come
        return launch.under_launcher(config)

    def meeting_point(self, config: EngineConfig) -> tuple[Any, str]:
        launched = _launched()
        return launch.open_store(launched, config.dist_init_timeout), launched.addr

    def start_workers(self, launch_: WorkerLaunch) -> Mapping[int, WorkerProcess]:
        return {}  # the launcher started them, and watches them


@hookimpl
def fw_register_executors(register) -> None:
    register(ExecutorSpec("external_launcher", ExternalLauncherExecutor, multi_node=True, starts_processes=False,
                          description="processes started by torchrun (env://); rank 0 serves, the others "
                                      "become workers"))
