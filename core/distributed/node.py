"""A machine other than node 0 (--node-rank > 0): it runs its share of the tensor-parallel ranks
as workers, started by the executor (--distributed-executor-backend), and waits for them; `fw serve` and `fw generate` come here instead of loading an
engine. It exits non-zero when one of its ranks fails (and says which and how)."""

from __future__ import annotations

import sys

from fw.config import EngineConfig
from fw.default_model import default_model
from fw.distributed.backend import executor_for, worker_launch
from fw.distributed.checks import check_layout
from fw.distributed.processes import describe_exit, stop_processes


def run_node(config: EngineConfig) -> int:
    """--node-rank > 0: run this node's ranks until they end; 0 when all stopped cleanly."""
    check_layout(config)
    if config.model is None:
        config.model = default_model()
    local_ranks = config.tensor_parallel_size // config.nnodes
    first = config.node_rank * local_ranks
    launch = worker_launch(config, config.dist_init_addr, range(first, first + local_ranks), local_ranks)
    procs = dict(executor_for(config).start_workers(launch))
    print(f"fw: node {config.node_rank}: tensor-parallel ranks {first}..{first + local_ranks - 1} joining "
          f"{config.dist_init_addr}", file=sys.stderr, flush=True)
    try:
        for proc in procs.values():
            proc.join()
    finally:
        stop_processes(procs, 0.0)
    failed = {rank: proc.exitcode for rank, proc in procs.items() if proc.exitcode}
    for rank, code in failed.items():
        print(f"fw: error: rank {rank} {describe_exit(code)}", file=sys.stderr)
    return 1 if failed else 0
