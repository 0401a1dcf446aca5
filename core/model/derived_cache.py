"""Files fw derives from a model's own files once and reuses on every later start (a GGUF file's
converted tokenizer, transformers' reading of a config or tokenizer), under `fw.paths.cache_dir()`.

Why: transformers' config classes and tokenizer loading cost seconds per start (importing
transformers alone is most of it), while their result for unchanged files is always the same. An
entry is keyed by the source files' paths, sizes and modification times and by the versions of
the libraries that produced it, so an edited file or an upgraded transformers makes a new entry.
Entries are written to a temporary folder and renamed into place: concurrent first starts never
see half an entry."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Callable, Iterable

from fw.paths import cache_dir

# Files of a model directory that never shape its config or tokenizer (the weights): left out of keys.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx", ".ckpt")


def _library_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "-"


def source_files(path: Path) -> list[Path]:
    """What an entry derived from `path` depends on: the file itself, or a directory's files but its weights."""
    if path.is_file():
        return [path]
    return sorted(p for p in path.iterdir() if p.is_file() and not p.name.endswith(_WEIGHT_SUFFIXES))


def entry_key(kind: str, files: Iterable[Path], *extra: str) -> str:
    """A key for `kind` derived from `files` (resolved path, size, mtime) with transformers' and
    tokenizers' versions, so that a change to any of them makes a new entry."""
    parts = [kind, _library_version("transformers"), _library_version("tokenizers"), *extra]
    for f in files:
        st = f.stat()
        parts.append(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def entry_dir(kind: str, key: str) -> Path:
    return cache_dir() / kind / key


def write_entry(target: Path, fill: Callable[[Path], None]) -> None:
    """Run `fill(folder)` on a fresh temporary folder beside `target`, then rename it to `target`
    (a concurrent writer that got there first wins; this one's folder is dropped)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        fill(tmp)
        os.replace(tmp, target)
    except OSError:
        if not target.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
