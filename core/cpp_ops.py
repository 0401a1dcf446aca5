"""Build a C++ operator library at first use and keep the build for the next process.

Why here: CPU kernels (fused layer ops in fw.layers, attention backends in
plugins) ship as C++ source and are compiled on the machine that runs them
(-O3 -march=native), with torch's cpp_extension. A build is keyed by the
source, the compiler flags, the torch version and the CPU's flags, and lives
under the fw cache dir, so a second start loads it in milliseconds and a
different machine sharing the cache never loads a build that is wrong for it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
from pathlib import Path

import torch

from fw.errors import FwError
from fw.paths import cache_dir

_lock = threading.Lock()
_loaded: set[str] = set()

DEFAULT_CFLAGS = ("-O3", "-march=native", "-fopenmp")
# fw's shared C++ headers (fw_simd.h), on every build's include path
INCLUDE_DIR = Path(__file__).with_name("csrc")


def missing_toolchain() -> str | None:
    """Why C++ ops cannot be built here (checked without building), or None."""
    if not (shutil.which("c++") or shutil.which("g++")):
        return "no C++ compiler (c++/g++) on PATH"
    if shutil.which("ninja") is None:
        try:
            import ninja  # noqa: F401  (the PyPI wheel ships the binary)
        except ImportError:
            return "ninja is not installed (pip install ninja)"
    return None


def _ensure_ninja_on_path() -> None:
    """The ninja wheel's binary is not on PATH when the venv is not activated."""
    if shutil.which("ninja") is None:
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def build_key(source_text: str, cflags: tuple[str, ...]) -> str:
    headers = [h.read_text() for h in sorted(INCLUDE_DIR.glob("*.h"))]
    parts = [source_text, *headers, *cflags, torch.__version__, _cpu_flags()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def load_cpp_ops(name: str, source: Path, cflags: tuple[str, ...] = DEFAULT_CFLAGS) -> None:
    """Compile (or load the cached build of) `source`, whose TORCH_LIBRARY registers torch.ops.<its
    namespace>; once per process. Raises FwError naming the build folder when it cannot."""
    if name in _loaded:
        return
    with _lock:
        if name in _loaded:
            return
        from torch.utils import cpp_extension

        text = source.read_text()
        key = build_key(text, cflags)
        build_dir = cache_dir() / name / key
        try:
            why = missing_toolchain()
            if why:
                raise RuntimeError(why)
            build_dir.mkdir(parents=True, exist_ok=True)
            _ensure_ninja_on_path()
            copy = build_dir / source.name
            if not copy.exists() or copy.read_text() != text:
                tmp = build_dir / f"{source.name}.{os.getpid()}"
                tmp.write_text(text)
                tmp.replace(copy)  # atomic: a concurrent builder never sees half a file
            cpp_extension.load(
                name=f"{name}_{key}", sources=[str(copy)], build_directory=str(build_dir),
                extra_cflags=list(cflags), extra_ldflags=["-fopenmp"], extra_include_paths=[str(INCLUDE_DIR)],
                is_python_module=False, verbose=False,
            )
        except Exception as exc:  # compiler errors, missing ninja, unwritable cache dir
            raise FwError(f"could not build the C++ ops {name!r} in {build_dir}: {exc}") from exc
        _loaded.add(name)
