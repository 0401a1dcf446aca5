"""The `cpu_paged` attention backend: `sdpa` with a C++ decode kernel for CPU.

Batched decode in `sdpa` gathers every sequence's pages into a padded
[Hkv, B, L, D] copy and runs two bmm's over it; at batch 64 that copy and the
padding cost more than the attention itself. This kernel reads K and V once,
straight from the paged cache through the block table: per (sequence, KV
head) it scores the group's query heads against the keys, softmaxes in fp32
and accumulates the values in fp32. Prefill chunks keep sdpa's code path.

The kernel is compiled at first use with torch's cpp_extension (-O3
-march=native, OpenMP through ATen's parallel_for) and cached under the fw
cache dir, keyed by the source, the torch version and the CPU's flags."""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fw.backends.attention.sdpa import SdpaBackend, _State
from fw.errors import FwError
from fw.layers.attention import AttentionMetadata
from fw.paths import cache_dir
from fw.plugins import AttentionBackendSpec, hookimpl

FW_PLUGIN_API_VERSION = "1.0"

# The kernel's C++ source, shipped beside this module (package data).
_SOURCE = (Path(__file__).with_name("cpu_paged.cpp")).read_text()

_lock = threading.Lock()
_built = False


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _missing_toolchain() -> str | None:
    """Why the kernel cannot be built here, checked without building it."""
    if not (shutil.which("c++") or shutil.which("g++")):
        return "no C++ compiler (c++/g++) on PATH to build the cpu_paged kernel"
    if shutil.which("ninja") is None:
        try:
            import ninja  # noqa: F401  (the PyPI wheel ships the binary)
        except ImportError:
            return "ninja is not installed (pip install ninja) to build the cpu_paged kernel"
    return None


def _ensure_ninja_on_path() -> None:
    """The ninja wheel's binary is not on PATH when the venv is not activated."""
    if shutil.which("ninja") is None:
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def load_kernel() -> None:
    """Build (or load the cached build of) the kernel once per process; registers torch.ops.fw_cpu_paged."""
    global _built
    if _built:
        return
    with _lock:
        if _built:
            return
        from torch.utils import cpp_extension

        key = hashlib.sha256("\0".join([_SOURCE, torch.__version__, _cpu_flags()]).encode()).hexdigest()[:16]
        build_dir = cache_dir() / "cpu_paged" / key
        try:
            build_dir.mkdir(parents=True, exist_ok=True)
            _ensure_ninja_on_path()
            source = build_dir / "cpu_paged.cpp"
            if not source.exists() or source.read_text() != _SOURCE:
                tmp = build_dir / f"cpu_paged.cpp.{os.getpid()}"
                tmp.write_text(_SOURCE)
                tmp.replace(source)  # atomic: a concurrent builder never sees half a file
            cpp_extension.load(
                name=f"fw_cpu_paged_{key}", sources=[str(source)], build_directory=str(build_dir),
                extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                is_python_module=False, verbose=False,
            )
        except Exception as exc:  # compiler errors, missing ninja, unwritable cache dir
            raise FwError(
                f"could not build the cpu_paged attention kernel in {build_dir}: {exc}\n"
                "Pass --attention-backend sdpa to run without it."
            ) from exc
        _built = True


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """out[b, h] = softmax(scale * q[b, h] . K_b^T) V_b, K_b/V_b the first seq_lens[b] positions of the
    pages block_tables[b] lists, read from k_cache/v_cache [Hkv, pages, page_size, D] of KV head
    h // (H // Hkv). q and out: [B, H, D]."""
    load_kernel()
    torch.ops.fw_cpu_paged.decode(q, k_cache, v_cache, block_tables, seq_lens, scale, out)


@dataclass
class _PagedState(_State):
    decodes: int = 0  # the first `decodes` sequences; sdpa's own num_decodes stays 0


class CpuPagedBackend(SdpaBackend):
    """sdpa's cache layout, KV writes and prefill; decodes run through the C++ kernel."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        load_kernel()  # at model build, not in the first step; a failed build is reported up front

    @classmethod
    def prepare(cls, meta: AttentionMetadata) -> _PagedState:
        """sdpa's prefill chunks only (no decode gather state), with the decode count kept aside so sdpa's
        forward skips its decode path."""
        return _PagedState(0, None, None, cls.prefill_chunks(meta), decodes=meta.num_decodes)

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        out = super().forward(q, k, v, kv_cache, meta)  # writes the new K/V, runs the prefill chunks
        d = meta.backend_state.decodes
        if d:
            paged_decode(q[:d], kv_cache[0], kv_cache[1], meta.block_tables[:d], meta.seq_lens_tensor[:d],
                         self.scale, out[:d])
        return out


@hookimpl
def fw_register_attention_backends(register) -> None:
    register(AttentionBackendSpec(
        name="cpu_paged",
        backend_cls=CpuPagedBackend,
        devices=("cpu",),
        dtypes=("float32", "bfloat16", "float16"),
        priority=10,
        available=_missing_toolchain,
        description="sdpa with a C++ CPU decode kernel reading K/V straight from the paged cache "
                    "(built at first use; needs a C++ compiler and ninja)",
    ))
