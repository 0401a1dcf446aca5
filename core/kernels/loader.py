"""Load fw's C++ operator libraries: the build `pip install` made, else a run-time build kept for the next process.

Why here: CPU kernels (fused layer ops in fw.layers, attention backends in plugins) ship as C++ source,
compiled for the machine that runs them (-O3 -march=native) with torch's cpp_extension. `pip install`
builds each library once, beside its source (setup.py; fw.kernels.build_record says what identifies a build), so a
start loads it in milliseconds and compiles nothing. When that library is missing (fw installed without
its C++ extensions, e.g. `pip install .` with build isolation, where torch is not there to build against)
or stale (its source, fw's headers, the flags, torch or the CPU changed since the install), the run-time
build is the fallback, and says so in one log line: built once under the fw cache dir, keyed like the
installed build, so a second start loads it and a different machine sharing the cache never loads a
build that is wrong for it. `FW_CPP_OPS_INSTALLED=0` ignores the installed libraries.

Several processes may start on an empty cache at once (`fw warm-cache` next to `fw serve`, or two
servers): one builds under an exclusive `fcntl` lock on the key's folder while the others wait on it,
the build happens in a private folder, and the finished library is moved into place with an atomic
rename, so no process ever loads a half-written library. The kernel drops the lock of a builder that
dies, so a crash never leaves the others waiting.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch

from fw import env
from fw.kernels import build_record
from fw.kernels.build_record import DEFAULT_CFLAGS, INCLUDE_DIR  # noqa: F401  (re-exported: the kernels' modules use them)
from fw.errors import FwError
from fw.paths import cache_dir

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_loaded: dict[str, str] = {}  # name -> where it came from: "installed", "cache" or "built"


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
        import ninja  # here: only a run-time build needs ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def build_key(source_text: str, cflags: tuple[str, ...]) -> str:
    return build_record.build_key(source_text, cflags, torch.__version__)


def use_installed() -> bool:
    return env.CPP_OPS_INSTALLED.get()


def installed(name: str, source: Path, cflags: tuple[str, ...] = DEFAULT_CFLAGS,
              source_text: str | None = None) -> tuple[Path | None, str]:
    """(the library `pip install` built from `source`, when it is current; else None and why not)."""
    if not use_installed():
        return None, "FW_CPP_OPS_INSTALLED=0"
    library = build_record.installed_library(name, source)
    if not library.is_file():
        return None, ("no installed build (fw was installed without its C++ extensions: "
                      "pip install --no-build-isolation builds them)")
    text = source.read_text() if source_text is None else source_text
    why = build_record.stale_reason(build_record.read_record(library),
                                 build_record.record(name, text, cflags, torch.__version__))
    if why is not None:
        return None, f"the installed build {library} is stale: {why}"
    return library, ""


def _cache_library(name: str, source_text: str, cflags: tuple[str, ...]) -> Path:
    key = build_key(source_text, cflags)
    return cache_dir() / name / key / f"{name}_{key}.so"


def library_path(name: str, source: Path, cflags: tuple[str, ...] = DEFAULT_CFLAGS) -> Path:
    """The library a process would load: the installed build when current, else the run-time build's place
    in the cache (whether or not it exists yet)."""
    library, _ = installed(name, source, cflags)
    return library or _cache_library(name, source.read_text(), cflags)


def is_built(name: str, source: Path, cflags: tuple[str, ...] = DEFAULT_CFLAGS) -> bool:
    """True when a current build is installed or in the cache (nothing is built or loaded)."""
    return library_path(name, source, cflags).is_file()


def unavailable(name: str, source: Path, cflags: tuple[str, ...] = DEFAULT_CFLAGS) -> str | None:
    """None when the library can be loaded here (installed, in the cache, or buildable), else why not."""
    if name in _loaded or is_built(name, source, cflags):
        return None
    return missing_toolchain()


def is_loaded(name: str) -> bool:
    return name in _loaded


def origin(name: str) -> str | None:
    """Where this process's copy of the library came from: "installed" (built by pip install), "cache" (a
    run-time build made earlier), "built" (compiled by this process), or None (not loaded)."""
    return _loaded.get(name)


def try_load_cpp_ops(name: str, source: Path, cflags: tuple[str, ...] = DEFAULT_CFLAGS) -> str | None:
    """`load_cpp_ops` for a kernel that has a slower fallback: None when loaded, else why not (no toolchain,
    or the build's error), for the caller's one warning."""
    try:
        load_cpp_ops(name, source, cflags)
        return None
    except FwError as exc:
        return str(exc)


def load_cpp_ops(name: str, source: Path, cflags: tuple[str, ...] = DEFAULT_CFLAGS) -> None:
    """Load the installed build of `source` (or the cached run-time build, or compile it), whose
    TORCH_LIBRARY registers torch.ops.<its namespace>; once per process. Raises FwError naming the build
    folder when it cannot."""
    if name in _loaded:
        return
    with _lock:
        if name in _loaded:
            return
        text = source.read_text()
        library, why_not_installed = installed(name, source, cflags, text)
        if library is not None:
            try:
                torch.ops.load_library(str(library))
                _loaded[name] = "installed"
                return
            except OSError as exc:  # dlopen fails before any op is registered: the run-time build can follow
                why_not_installed = f"the installed build {library} does not load ({exc})"
        key = build_key(text, cflags)
        build_dir = cache_dir() / name / key
        library = build_dir / f"{name}_{key}.so"
        try:
            if library.is_file():
                logger.info("C++ ops %s: %s; loading the run-time build %s", name, why_not_installed, library)
                torch.ops.load_library(str(library))
                _loaded[name] = "cache"
                return
            why = missing_toolchain()
            if why:
                raise RuntimeError(f"{why} ({why_not_installed})")
            logger.warning("C++ ops %s: %s; building it now into %s (once per machine)", name,
                           why_not_installed, build_dir)
            build_dir.mkdir(parents=True, exist_ok=True)
            with _exclusive(build_dir / ".lock", name):
                if library.is_file():  # another process built it while this one waited
                    torch.ops.load_library(str(library))
                    _loaded[name] = "cache"
                else:
                    _build_and_load(name, key, text, source.name, cflags, build_dir, library)
                    _loaded[name] = "built"
        except Exception as exc:  # compiler errors, missing ninja, unwritable cache dir
            raise FwError(f"could not build the C++ ops {name!r} in {build_dir}: {exc}") from exc


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
    from torch.utils import cpp_extension  # here: cpp_extension costs start-up time; only a run-time build needs it

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


_faked: set[str] = set()


def register_fake(op: str, fake: Callable[..., object]) -> None:
    """Give a loaded library's op (`namespace::name`) its shape-only kernel, once per process: torch.compile traces
    fw's kernels as opaque calls through these (a second registration would be an error)."""
    if op not in _faked:
        torch.library.register_fake(op)(fake)
        _faked.add(op)
