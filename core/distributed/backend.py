"""Which executor starts this engine's ranks (--distributed-executor-backend; the rule is
fw.plan.rules.choose_executor), what it is asked to start, and the start of `fw serve` /
`fw generate`, where it may take over the process (`prepare_process`)."""

from __future__ import annotations

from fw.config import EngineConfig
from fw.distributed import launch
from fw.plugins.executor import Executor, WorkerLaunch
from fw.plan.rules import choose_executor
from fw.plugins.manager import PluginManager, engine_plugins


def executor_for(config: EngineConfig, plugins: PluginManager | None = None) -> Executor | None:
    """A new instance of the executor `config` names (or auto's choice); None for auto at one rank
    without a launcher, where there is nothing to start (so plugins that leave out the executors,
    FW_PLUGINS=..., still run one process)."""
    launched = launch.from_env() is not None
    if config.distributed_executor_backend == "auto" and config.tensor_parallel_size == 1 and not launched:
        return None
    return choose_executor(config, engine_plugins(config, plugins), launched).factory()


def worker_launch(config: EngineConfig, addr: str, ranks: range, local_ranks: int) -> WorkerLaunch:
    """What an executor is asked to start: `ranks`, each running fw's worker main."""
    from fw.distributed.worker import run_worker  # here: the worker imports the loader and the model runner

    return WorkerLaunch(config, addr, tuple(ranks), local_ranks, run_worker)


def prepare_process(config: EngineConfig) -> EngineConfig:
    """`fw serve` and `fw generate` call this first: the executor's `prepare` (under torchrun,
    `external_launcher` reads the layout and turns every rank but 0 into a worker here)."""
    executor = executor_for(config)
    return config if executor is None else executor.prepare(config)

