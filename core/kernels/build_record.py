"""What identifies a build of one of fw's C++ libraries, and the record an install-time build leaves beside it.

Why a module of its own: two builders must agree on it. `pip install` builds every library once (setup.py,
with torch's BuildExtension) and `fw.kernels.loader` loads that build at run time, or builds into the fw cache when
it is missing or stale. setup.py runs before fw is importable, so it loads this file by path: it imports
nothing but the standard library (no torch, no fw).

A build is keyed by its source, fw's shared headers (fw/kernels/*.h), the compiler flags, the torch version and
the CPU's flags (-march=native): a build for another CPU or another torch is never loaded.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

DEFAULT_CFLAGS = ("-O3", "-march=native", "-fopenmp")
# fw's shared C++ headers (fw_simd.h), on every build's include path
INCLUDE_DIR = Path(__file__).parent


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def headers_text() -> list[str]:
    return [h.read_text() for h in sorted(INCLUDE_DIR.glob("*.h"))]


def build_key(source_text: str, cflags: tuple[str, ...], torch_version: str) -> str:
    """The run-time build cache's folder name for this build (the same key as before installed builds)."""
    parts = [source_text, *headers_text(), *cflags, torch_version, cpu_flags()]
    return _sha("\0".join(parts))[:16]


def record(name: str, source_text: str, cflags: tuple[str, ...], torch_version: str) -> dict:
    """What an installed build was made from, kept beside it; compared field by field to say why it is stale."""
    return {
        "name": name,
        "key": build_key(source_text, cflags, torch_version),
        "source_sha256": _sha("\0".join([source_text, *headers_text()])),
        "cflags": list(cflags),
        "torch": torch_version,
        "cpu_flags_sha256": _sha(cpu_flags()),
    }


def installed_library(name: str, source: Path) -> Path:
    """Where `pip install` puts the build of `source`: beside it, as lib<name>.so (not importable as a module:
    it registers torch ops, it is not a Python extension)."""
    return source.with_name(f"lib{name}.so")


def record_path(library: Path) -> Path:
    return library.with_name(library.name + ".json")


def write_record(library: Path, rec: dict) -> None:
    record_path(library).write_text(json.dumps(rec, indent=1) + "\n")


def read_record(library: Path) -> dict | None:
    try:
        return json.loads(record_path(library).read_text())
    except (OSError, ValueError):
        return None


def stale_reason(installed: dict | None, expected: dict) -> str | None:
    """None when the installed build is the one `expected` describes, else why not (for one log line)."""
    if installed is None:
        return "its build record is missing"
    if installed.get("source_sha256") != expected["source_sha256"]:
        return "its source changed since it was installed"
    if installed.get("torch") != expected["torch"]:
        return f"it was built for torch {installed.get('torch')}, this is torch {expected['torch']}"
    if installed.get("cflags") != expected["cflags"]:
        return f"it was built with other compiler flags ({' '.join(installed.get('cflags') or [])})"
    if installed.get("cpu_flags_sha256") != expected["cpu_flags_sha256"]:
        return "it was built on a CPU with other features (-march=native)"
    if installed.get("key") != expected["key"]:
        return "its build key differs"
    return None
