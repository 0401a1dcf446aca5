"""Ranks started by an external launcher (torchrun, or anything that sets torch's env:// variables:
RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT).

Every process the launcher starts runs the same `fw serve` (or `fw generate`) command. Rank 0 runs
the engine (and serves), exactly as when fw spawns its workers itself; every other rank becomes a
worker in the launcher's process instead of one fw spawns. The ranks meet in torchrun's own store
(TORCHELASTIC_USE_AGENT_STORE), under a prefix of their own, or else in a store rank 0 serves at
MASTER_ADDR:MASTER_PORT; from there on it is fw's usual start-up (fw.distributed.rendezvous): the
same join deadline, the same comparison of options, the same errors."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from fw.config import EngineConfig
from fw.distributed import rendezvous
from fw.errors import ConfigError, DistributedError

_NEEDED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Launched:
    rank: int
    world: int
    local_rank: int
    local_world: int
    addr: str  # MASTER_ADDR:MASTER_PORT
    agent_store: bool  # torchrun serves the store at addr (every rank connects as a client)
    prefix: str  # the keys of this start (a torchrun restart starts afresh)

    @property
    def nnodes(self) -> int:
        return self.world // self.local_world

    @property
    def node_rank(self) -> int:
        return self.rank // self.local_world


def from_env(environ=os.environ) -> Launched | None:
    """The launcher's layout, or None when fw was not started by one (no RANK/WORLD_SIZE, or a world of 1)."""
    if not all(name in environ for name in _NEEDED) or int(environ["WORLD_SIZE"]) <= 1:
        return None
    world = int(environ["WORLD_SIZE"])
    local_world = int(environ.get("LOCAL_WORLD_SIZE", world))
    return Launched(rank=int(environ["RANK"]), world=world, local_rank=int(environ.get("LOCAL_RANK", environ["RANK"])),
                    local_world=local_world, addr=f"{environ['MASTER_ADDR']}:{environ['MASTER_PORT']}",
                    agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
                    prefix=f"fw/{environ.get('TORCHELASTIC_RUN_ID', '')}/{environ.get('TORCHELASTIC_RESTART_COUNT', 0)}/")


def configure(config: EngineConfig, launched: Launched) -> EngineConfig:
    """`config` with the launcher's layout: --tensor-parallel-size is its world size (given or not; a
    different one is an error), --nnodes and --node-rank follow from its variables."""
    tp = config.tensor_parallel_size
    if tp not in (1, launched.world):
        raise ConfigError(f"--tensor-parallel-size {tp}: the launcher started {launched.world} processes "
                          f"(WORLD_SIZE); give --tensor-parallel-size {launched.world} or start {tp} processes "
                          f"(torchrun --nproc-per-node)")
    if launched.world % launched.local_world:
        raise ConfigError(f"WORLD_SIZE {launched.world} is not a multiple of LOCAL_WORLD_SIZE {launched.local_world}: "
                          f"give every node the same number of processes")
    if config.data_parallel_size > 1:
        raise ConfigError(f"--data-parallel-size {config.data_parallel_size}: under a launcher (WORLD_SIZE "
                          f"{launched.world}) every process is one tensor-parallel rank; drop --data-parallel-size")
    return dataclasses.replace(config, tensor_parallel_size=launched.world, nnodes=launched.nnodes,
                               node_rank=launched.node_rank, dist_init_addr=launched.addr)


def open_store(launched: Launched, timeout_s: float) -> dist.Store:
    """The store the ranks meet in: the launcher's, under this start's prefix, or one rank 0 serves."""
    if launched.agent_store:
        host, port = rendezvous.split_addr(launched.addr)
        try:
            store = dist.TCPStore(host, port, None, False, timeout=timedelta(seconds=timeout_s))
        except (RuntimeError, OSError) as exc:
            raise DistributedError(f"rank {launched.rank} could not reach the launcher's store at {launched.addr} "
                                   f"(MASTER_ADDR:MASTER_PORT): {str(exc).splitlines()[0]}") from None
        return dist.PrefixStore(launched.prefix, store)
    if launched.rank == 0:
        return rendezvous.serve_store(launched.addr, launched.world, timeout_s)[0]
    return rendezvous.reach_store(launched.addr, launched.rank, timeout_s)


def run_launched_worker(config: EngineConfig, launched: Launched) -> int:
    """A rank other than 0: this process is the worker (it does not return)."""
    from fw.distributed.worker import run_worker  # here: only a worker rank loads the worker and its engine

    run_worker(config, launched.rank, launched.addr, launched.local_rank, launched.local_world,
               connect=lambda addr, rank, timeout: open_store(launched, timeout))
    return 0


def under_launcher(config: EngineConfig) -> EngineConfig:
    """`fw serve` and `fw generate` call this first: without a launcher `config` as given; under one, rank 0
    goes on with the launcher's layout and every other rank becomes a worker here (this never returns)."""
    launched = from_env()
    if launched is None:
        return config
    config = configure(config, launched)
    if launched.rank > 0:
        run_launched_worker(config, launched)
    return config
