"""Where the ranks meet: a TCPStore served by rank 0, a join deadline, and per-rank error reports.

Why not torch.distributed.init_process_group's own rendezvous: it waits 30 minutes by default and
then says only that it timed out. Here every rank announces itself under `joined/<rank>` as soon
as it reaches the store, and rank 0 waits for them with --dist-init-timeout, so the error names
the address and the ranks that never came. A rank that fails later (say, loading its shard)
writes its message under `error/<rank>`, and rank 0 reports that message instead of a socket
error. The gloo group binds the interface that reaches rank 0's address, not whatever the host
name resolves to (GLOO_SOCKET_IFNAME overrides), a classic multi-node trap."""

from __future__ import annotations

import json
import os
import socket
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from fw.errors import DistributedError
from fw.version import __version__

LOOPBACK = "127.0.0.1"
_POLL_S = 0.05


def split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


def serve_store(addr: str | None, world: int, timeout_s: float) -> tuple[dist.TCPStore, str]:
    """Rank 0's store, listening at `addr` (HOST:PORT) or on a free loopback port; returns it and the
    address the other ranks must use. The socket is bound here, so a port in use is one sentence."""
    host, port = split_addr(addr) if addr else (LOOPBACK, 0)
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(("" if addr else host, port))  # a given address: listen on every interface
        listener.listen(world * 4)
    except OSError as exc:
        listener.close()
        raise DistributedError(f"--dist-init-addr {addr}: rank 0 cannot listen on port {port} ({exc.strerror}); "
                               f"choose a free port") from None
    port = listener.getsockname()[1]
    store = dist.TCPStore(host, port, world, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False,
                          master_listen_fd=listener.detach())
    return store, f"{host}:{port}"


def reach_store(addr: str, rank: int, timeout_s: float) -> dist.TCPStore:
    """A worker's connection to rank 0's store; a clear error when nothing answers within the timeout."""
    host, port = split_addr(addr)
    try:
        return dist.TCPStore(host, port, None, False, timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, OSError) as exc:
        raise DistributedError(
            f"rank {rank} could not reach rank 0 at {addr} within {timeout_s:g} s (--dist-init-timeout): "
            f"{str(exc).splitlines()[0]}. Check that node 0 is running with the same --dist-init-addr, that "
            f"{host} is node 0's address as seen from this machine, and that port {port} is open") from None


# The options every rank must share: they decide what each rank builds, loads and computes. A node started
# with another --dtype would all-reduce tensors of another size; one with another model, garbage.
SHARED_OPTIONS = ("model", "revision", "dtype", "quantization", "gguf_dequantize_at_load", "rope_type", "model_impl",
                  "max_length", "kv_cache_page_size", "kv_cache_dtype", "attention_backend", "moe_backend",
                  "tensor_parallel_size", "nnodes")


def fingerprint(config) -> dict:
    """What a rank tells rank 0 when it joins: where it runs, its versions and its shared options."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "fw": __version__, "torch": torch.__version__,
            **{name: getattr(config, name) for name in SHARED_OPTIONS}}


def announce(store: dist.Store, rank: int, config) -> None:
    store.set(f"joined/{rank}", json.dumps(fingerprint(config), default=str))


def _mismatch(rank: int, theirs: dict, ours: dict) -> str | None:
    for key, value in ours.items():
        if key in ("host", "pid"):
            continue
        if theirs.get(key) != value:
            what = f"--{key.replace('_', '-')}" if key in SHARED_OPTIONS else f"{key} version"
            return (f"rank {rank} (host {theirs.get('host')}) runs with {what} {theirs.get(key)!r}, rank 0 with "
                    f"{value!r}; start every node with the same options and versions")
    return None


def report_error(store: dist.Store | None, rank: int, message: str) -> None:
    """Leave `message` for rank 0 to report (best effort: the store may be gone with rank 0)."""
    if store is None:
        return
    try:
        store.set(f"error/{rank}", message)
    except Exception:
        pass


def reported_errors(store: dist.Store, ranks) -> dict[int, str]:
    found = {}
    for rank in ranks:
        try:
            if store.check([f"error/{rank}"]):
                found[rank] = store.get(f"error/{rank}").decode(errors="replace")
        except Exception:  # the store itself is unreachable: nothing more to learn
            break
    return found


def wait_for_ranks(store: dist.Store, ranks: list[int], addr: str, timeout_s: float, config,
                   check: Callable[[], None] = lambda: None) -> None:
    """Until every rank in `ranks` announced itself with the options and versions of `config`; `check`
    raises when a local worker died first. On timeout the error names the ranks that did not join and
    where they were expected."""
    deadline = time.monotonic() + timeout_s
    ours = json.loads(json.dumps(fingerprint(config), default=str))
    missing = list(ranks)
    while True:
        joined = [r for r in missing if store.check([f"joined/{r}"])]
        for rank in joined:
            why = _mismatch(rank, json.loads(store.get(f"joined/{rank}")), ours)
            if why:
                raise DistributedError(why)
        missing = [r for r in missing if r not in joined]
        errors = reported_errors(store, ranks)
        if errors:
            rank, message = min(errors.items())
            raise DistributedError(f"rank {rank} failed while starting: {message}")
        check()
        if not missing:
            return
        if time.monotonic() > deadline:
            raise DistributedError(
                f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did not join at {addr} "
                f"within {timeout_s:g} s (--dist-init-timeout). Start every node with the same "
                f"--dist-init-addr {addr}, --nnodes and its own --node-rank, and check that the port is open "
                f"from the other machines")
        time.sleep(_POLL_S)


def release(store: dist.Store, reason: str | None = None) -> None:
    """Rank 0's word to the ranks waiting in `wait_for_release`: go on, or give up with `reason`."""
    try:
        store.set("abort" if reason else "go", reason or "1")
    except Exception:  # a store that is gone: the workers' next store call fails on its own
        pass


def wait_for_release(store: dist.Store, rank: int, timeout_s: float) -> None:
    """A worker, after joining: wait until rank 0 has seen every rank (and their options) before forming
    the group, so a start-up rank 0 gave up on ends here at once, with rank 0's reason, rather than
    in the group's connect timeout."""
    deadline = time.monotonic() + timeout_s
    while not store.check(["go"]):
        if store.check(["abort"]):
            raise DistributedError(f"rank {rank}: rank 0 gave up the start-up: {store.get('abort').decode()}")
        if time.monotonic() > deadline:
            raise DistributedError(f"rank {rank}: rank 0 did not see every rank join within {timeout_s:g} s "
                                   f"(--dist-init-timeout)")
        time.sleep(_POLL_S)


def local_address_towards(host: str) -> str:
    """The address of the interface this machine uses to reach `host` (no packet is sent)."""
    if host in (LOOPBACK, "localhost", "::1"):
        return host
    probe = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((host, 9))
        return probe.getsockname()[0]
    except OSError:
        return socket.gethostname()
    finally:
        probe.close()


def gloo_group(store: dist.Store, rank: int, world: int, timeout_s: float, master_host: str):
    """The gloo process group of all ranks, on the interface that reaches rank 0 (or GLOO_SOCKET_IFNAME)."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=timeout_s)
    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    if interface:
        options._devices = [dist.ProcessGroupGloo.create_device(interface=interface.split(",")[0])]
    else:
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address_towards(master_host))]
    try:
        return dist.ProcessGroupGloo(dist.PrefixStore("pg/gloo", store), rank, world, options)
    except RuntimeError as exc:
        raise DistributedError(
            f"rank {rank}: the gloo group of {world} ranks did not connect ({str(exc).splitlines()[0]}); "
            f"if the machines have several network interfaces, set GLOO_SOCKET_IFNAME to the one that "
            f"reaches {master_host}") from None


def device_group(store: dist.Store, rank: int, world: int, timeout_s: float, device: str, gloo):
    """The group the model's all-reduces run in: NCCL for CUDA tensors, else the gloo group itself.
    (The step broadcast always uses gloo: its tensors start on rank 0's CPU.) Not yet run on GPUs."""
    if not str(device).startswith("cuda"):
        return gloo
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timedelta(seconds=timeout_s)
    return dist.ProcessGroupNCCL(dist.PrefixStore("pg/nccl", store), rank, world, options)
