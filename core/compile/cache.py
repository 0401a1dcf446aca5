"""fw's compile cache: one folder per cache key under `--compile-cache-dir`.

Why per key: torch's own caches (Inductor's FX graph cache, the AOTAutograd
cache and the compiled C++ kernels) are content-addressed and shared by
everything a process compiles; fw needs to say, before loading anything, what
a flag set has compiled (`fw warm-cache --check`), to bound the disk it uses,
and never to mix two configurations. So each key gets its own torch cache
folder (`<root>/<key>/inductor`, used as TORCHINDUCTOR_CACHE_DIR while fw
compiles), each bucket's captured graph as a file (`<root>/<key>/graphs`,
fw.compile.graphs: what a warm start loads) and a manifest of the buckets
warm-up compiled into it.

The key hashes everything that changes the compiled graphs: the model (path,
revision, and each weight/config file's size and mtime), dtype, quantization,
KV-cache dtype, attention backend, bucket sets, compile mode, device (the CPU's
flags, or the GPU's name and capability) and the versions of Python, torch,
fw (and fw.compile's own sources) and every loaded plugin distribution. A
changed input gives another key, hence a miss, never a stale hit; and torch's
keys inside a folder hash the graphs themselves.

Several processes may use one root: a warm-up compiles under an exclusive
`fcntl` lock of its key (a second process waits, then finds everything
compiled), manifests are replaced by atomic renames, and eviction skips keys
whose lock is held. `--compile-cache-size-mb` caps the root: after a warm-up
the least recently used keys (manifest mtime; every engine start touches its
own) are deleted until the rest fit.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import platform
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from fw import __version__, env, kernels
from fw.compile.graphs import GRAPHS, available, graph_name
from fw.paths import cache_dir

logger = logging.getLogger("fw.compile")

MANIFEST = "manifest.json"
_ENV_INPUTS = (env.CPU_FUSED_OPS, env.CPU_WEIGHT_PACKING, env.CPU_PACKED_INT)  # change which ops the graphs hold
_MODEL_FILES = ("*.json", "*.safetensors", "*.gguf", "*.bin", "*.pt")


def default_root() -> Path:
    return cache_dir() / "compile"


def cache_root(config) -> Path:
    return Path(os.path.expanduser(config.compile_cache_dir)) if config.compile_cache_dir else default_root()


def _file_fingerprints(path: Path) -> list[list[Any]]:
    files = [path] if path.is_file() else sorted({f for pattern in _MODEL_FILES for f in path.glob(pattern)})
    out = []
    for f in files:
        st = f.stat()  # follows the HF cache's symlinks to the blobs
        out.append([f.name, st.st_size, st.st_mtime_ns])
    return out


def _device_identity(device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        index = device.index or 0
        if torch.cuda.is_available():
            return {"type": "cuda", "name": torch.cuda.get_device_name(index),
                    "capability": list(torch.cuda.get_device_capability(index)), "cuda": torch.version.cuda}
        return {"type": "cuda"}
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return {"type": device.type, "machine": platform.machine(),
            "cpu_flags": hashlib.sha256(flags.encode()).hexdigest()[:16]}


def _compile_sources_hash() -> str:
    """fw.compile's own code decides what the graphs contain (ops, padding), with the packed linear's kernel
    it calls (fw.kernels): a change invalidates."""
    here = Path(__file__).parent
    digest = hashlib.sha256()
    for f in sorted(here.glob("*.py")) + [kernels.source("packed_linear.cpp")]:
        digest.update(f.name.encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()[:16]


def _plugin_versions(plugins) -> list[list[str]]:
    if plugins is None:
        return []
    return sorted({(p.distribution, p.version) for p in plugins.plugins.values() if not p.error and not p.disabled})


def key_inputs(config, plan, buckets, plugins) -> dict[str, Any]:
    """Everything the key hashes, as a JSON-able dict (kept in the manifest to explain a key). The
    decisions (dtype, quantization, attention backend, device) are the engine plan's (fw.plan)."""
    # here: the plan's rules load the model loader; only a compiled engine keys
    from fw.plan.rules import checkpoint_quantization

    source = plan.source
    return {
        "model": {"kind": source.kind, "path": str(source.path), "revision": config.revision,
                  "files": _file_fingerprints(source.path)},
        "model_impl": config.model_impl,
        "dtype": str(plan.dtype).removeprefix("torch."),
        "quantization": {"method": config.quantization, "checkpoint": checkpoint_quantization(plan.hf_config),
                         "gguf_dequantize_at_load": plan.gguf_dequantize_at_load, "rope_type": config.rope_type},
        "kv_cache_dtype": config.kv_cache_dtype,
        # named: the engine runs that backend or refuses to start (warm-cache need not judge it)
        "attention_backend": (config.attention_backend if config.attention_backend != "auto"
                              else plan.attention.chosen.name),
        "moe_backend": config.moe_backend,
        "buckets": buckets.as_dict(),
        "compile_mode": config.compile_mode or "default",
        "device": _device_identity(plan.device),
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__, "fw": __version__,
                     "fw.compile": _compile_sources_hash(), "plugins": _plugin_versions(plugins)},
        "env": {switch.name: switch.raw() for switch in _ENV_INPUTS},
    }


def cache_key(inputs: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:24]


@dataclass
class CacheEntry:
    root: Path
    key: str

    @property
    def folder(self) -> Path:
        return self.root / self.key

    @property
    def inductor_dir(self) -> Path:
        return self.folder / "inductor"

    @property
    def graphs_dir(self) -> Path:
        return self.folder / GRAPHS

    @property
    def lock_path(self) -> Path:
        return self.root / f"{self.key}.lock"  # beside the folder: eviction deletes the folder, not the lock

    def manifest(self) -> dict[str, Any] | None:
        try:
            return json.loads((self.folder / MANIFEST).read_text())
        except (OSError, ValueError):
            return None

    def compiled_buckets(self) -> dict[str, set[int]]:
        """The buckets a start can load: listed by the manifest, and (where torch saves graphs) with their
        graph's file present, since that file is what a start loads."""
        data = self.manifest() or {}
        compiled = data.get("compiled", {})
        out = {dim: set(compiled.get(dim, [])) for dim in ("tokens", "batch")}
        if available():
            out = {dim: {b for b in values if (self.graphs_dir / graph_name(dim, b)).is_file()}
                   for dim, values in out.items()}
        return out

    def write_manifest(self, data: dict[str, Any]) -> None:
        """Atomically: a reader sees the old manifest or the new one, never half of one."""
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.folder / f".{MANIFEST}.{os.getpid()}"
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True, default=str))
        os.replace(tmp, self.folder / MANIFEST)

    def touch(self) -> None:
        """Mark the key used now (eviction removes the least recently used first)."""
        path = self.folder / MANIFEST
        if path.is_file():
            os.utime(path)

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the key's lock for the block, waiting for another process that holds it."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.lock_path, "a+") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                logger.info("compile cache %s: waiting for another process that is compiling it", self.key)
                fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


def folder_size(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


def evict(root: Path, cap_bytes: int, keep: str | None = None) -> list[str]:
    """Delete least recently used keys until the root holds at most `cap_bytes` (0: no cap); a key
    being compiled (its lock held) and `keep` are never deleted. Returns the deleted keys."""
    if cap_bytes <= 0 or not root.is_dir():
        return []
    entries = []
    for folder in root.iterdir():
        if not folder.is_dir():
            continue
        manifest = folder / MANIFEST
        used = manifest.stat().st_mtime if manifest.is_file() else folder.stat().st_mtime
        entries.append((used, folder.name, folder_size(folder)))
    total = sum(size for _, _, size in entries)
    deleted = []
    for _, key, size in sorted(entries):
        if total <= cap_bytes:
            break
        if key == keep:
            continue
        lock_path = root / f"{key}.lock"
        with open(lock_path, "a+") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # another process is compiling into it
            try:
                shutil.rmtree(root / key, ignore_errors=True)
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
        total -= size
        deleted.append(key)
        logger.info("compile cache: evicted %s (%.1f MB) to stay under %.0f MB", key, size / 2**20, cap_bytes / 2**20)
    return deleted


def new_manifest(key: str, inputs: dict[str, Any], compiled_tokens: list[int], compiled_batch: list[int],
                 graphs: int, seconds: float) -> dict[str, Any]:
    return {"key": key, "inputs": inputs, "compiled": {"tokens": sorted(compiled_tokens), "batch": sorted(compiled_batch)},
            "graphs": graphs, "warmup_seconds": round(seconds, 3), "written": time.time()}
