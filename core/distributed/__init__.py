"""Tensor parallelism over torch.distributed (gloo on CPU, NCCL on CUDA); docs/distributed.md.

Rank 0 is the engine as it runs in one process (scheduler, KV page bookkeeping, sampling,
grammar, detokenizer) plus its shard of the model; every other rank runs only the forward step,
fed each step by a broadcast of that step's integer tensors from rank 0 (`step.py`). Sampling
happens once, on rank 0, so ranks cannot disagree about a token.

- `group.py`: `TensorParallel`, a rank's group and its all-reduce (what the layers see)
- `shm.py`: the all-reduce of one machine's CPU ranks, through shared memory (gloo's costs 30x more)
- `rendezvous.py`: the meeting point (a TCPStore), join deadlines, per-rank error reports
- `step.py`: the per-step wire format (a fixed header, then one int64 tensor)
- `cluster.py`: rank 0's side: starting the ranks, watching this node's workers, driving each step
- `backend.py`: which executor plugin starts the ranks (--distributed-executor-backend; fw.plugins.executor)
- `processes.py`: stopping the worker processes an executor started
- `worker.py`: the other ranks' side: load a shard, then step as told
- `node.py`: a machine that runs only workers (--node-rank > 0)
- `checks.py`: what cannot be split, refused before any process starts
- `threads.py`: each rank's cores and torch threads

This package's __init__ imports nothing: the layers import `group` while the engine imports
`cluster`, which imports the loader, which imports the layers.
"""
