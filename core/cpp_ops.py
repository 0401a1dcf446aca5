"""Build a C++ operator library at first use and keep the build for the next process.

Why here: CPU kernels (fused layer ops in fw.layers, attention backends in
plugins) ship as C++ source and are compiled on the machine that runs them
(-O3 -march=native), with torch's cpp_extension. A build is keyed by the
source, the compiler flags, the torch version and the CPU's flags, and lives
under the fw cache dir, so a second start loads it in milliseconds and a
different machine sharing the cache never loads a build that is wrong for it.

Several processes may start on an empty cache at once (`fw warm-cache` next to
`fw serve`, or two servers): one builds under an exclusive `fcntl` lock on the
key's folder while the others wait on it, the build happens in a private
folder, and the finished library is moved into place with an atomic rename, so
no process ever loads a half-written library. The kernel drops the lock of a
builder that dies, so a crash never leaves the others waiting.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from fw.errors import FwError
from fw.paths import cache_dir

logger = logging.getLogger(__name__)

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


def library_path(name: str, source: Path, cflags: tuple[str, ...] = DEFAULT_CFLAGS) -> Path:
    """Where the build of `source` for this machine lives (whether or not it exists yet)."""
    key = build_key(source.read_text(), cflags)
    return cache_dir() / name / key / f"{name}_{key}.so"


def is_built(name: str, source: Path, cflags: tuple[str, ...] = DEFAULT_CFLAGS) -> bool:
    """True when a finished build is in the cache (nothing is built or loaded)."""
    return library_path(name, source, cflags).is_file()


def is_loaded(name: str) -> bool:
    return name in _loaded


def try_load_cpp_ops(name: str, source: Path, cflags: tuple[str, ...] = DEFAULT_CFLAGS) -> str | None:
    """`load_cpp_ops` for a kernel that has a slower fallback: None when loaded, else why not (no toolchain,
    or the build's error), for the caller's one warning."""
    why = missing_toolchain()
    if why is not None:
        return why
    try:
        load_cpp_ops(name, source, cflags)
        return None
    except FwError as exc:
        return str(exc)


def load_cpp_ops(name: str, source: Path, cflags: tuple[str, ...] = DEFAULT_CFLAGS) -> None:
    """Compile (or load the cached build of) `source`, whose TORCH_LIBRARY registers torch.ops.<its
    namespace>; once per process. Raises FwError naming the build folder when it cannot."""
    if name in _loaded:
        return
    with _lock:
        if name in _loaded:
            return
        text = source.read_text()
        key = build_key(text, cflags)
        build_dir = cache_dir() / name / key
        library = build_dir / f"{name}_{key}.so"
        try:
            if library.is_file():
                torch.ops.load_library(str(library))
            else:
                why = missing_toolchain()
                if why:
                    raise RuntimeError(why)
                build_dir.mkdir(parents=True, exist_ok=True)
                with _exclusive(build_dir / ".lock", name):
                    if library.is_file():  # another process built it while this one waited
                        torch.ops.load_library(str(library))
                    else:
                        _build_and_load(name, key, text, source.name, cflags, build_dir, library)
        except Exception as exc:  # compiler errors, missing ninja, unwritable cache dir
            raise FwError(f"could not build the C++ ops {name!r} in {build_dir}: {exc}") from exc
        _loaded.add(name)


@contextmanager
def _exclusive(lock_path: Path, name: str) -> Iterator[None]:
    """An exclusive advisory lock on `lock_path`, held for the block (released by the kernel if the
    process dies)."""
    with open(lock_path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process that is building the C++ ops %s", name)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build_and_load(name: str, key: str, text: str, source_name: str, cflags: tuple[str, ...],
                    build_dir: Path, library: Path) -> None:
    """Build in a private folder (cpp_extension loads the result from there), then move the library
    into `library` with an atomic rename; the loaded mapping survives the rename."""
    from torch.utils import cpp_extension

    _ensure_ninja_on_path()
    work = Path(tempfile.mkdtemp(prefix=f"build-{os.getpid()}-", dir=build_dir))
    try:
        copy = work / source_name
        copy.write_text(text)
        cpp_extension.load(
            name=f"{name}_{key}", sources=[str(copy)], build_directory=str(work),
            extra_cflags=list(cflags), extra_ldflags=["-fopenmp"], extra_include_paths=[str(INCLUDE_DIR)],
            is_python_module=False, verbose=False,
        )
        os.replace(work / library.name, library)
    finally:
        shutil.rmtree(work, ignore_errors=True)
