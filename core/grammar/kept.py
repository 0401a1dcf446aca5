"""Compiled grammars kept on disk across processes: what `fw warm-cache --warm-schemas` stores and a
grammar backend's compiler reads back before compiling (docs/warm-cache.md).

Why in fw.grammar: a serving process reads kept grammars at every request's compile, so the store is
part of the grammar-backend API (`KeptGrammars`, `GrammarStore`); the warm-cache command that fills it
(fw.warm.grammar) is tooling the backends never import."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, TypeVar

from fw.paths import cache_dir
from fw.version import __version__

logger = logging.getLogger("fw.warm")

T = TypeVar("T")


def store_root(backend: str) -> Path:
    return cache_dir() / "grammars" / backend


class GrammarStore:
    """Compiled grammars of one backend kept on disk across processes: one file per constraint,
    written with an atomic rename so concurrent writers and readers never see half a file.
    `version` must change whenever the backend's compiled form or compile options change."""

    def __init__(self, backend: str, version: str, tokenizer: Any):
        self.backend = backend
        self.root = store_root(backend)
        self._salt = [backend, version, __version__, tokenizer.cache_key]

    def path(self, constraint: Any) -> Path:
        text = json.dumps([*self._salt, constraint.kind, constraint.value])
        return self.root / f"{hashlib.sha256(text.encode()).hexdigest()[:32]}.bin"

    def has(self, constraint: Any) -> bool:
        return self.path(constraint).is_file()

    def load(self, constraint: Any) -> bytes | None:
        try:
            return self.path(constraint).read_bytes()
        except OSError:
            return None

    def save(self, constraint: Any, data: bytes) -> Path:
        path = self.path(constraint)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path


class KeptGrammars:
    """A grammar compiler's kept grammars: its `GrammarStore`, opened at first use (keying it hashes
    the vocabulary, which a server that never warmed anything should not pay) from any thread, and
    an entry this build cannot read (another library version, a damaged file) is compiled instead."""

    def __init__(self, backend: str, version: Callable[[], str], tokenizer: Any):
        self.backend = backend
        self._version = version  # called once, when the store is opened
        self._tokenizer = tokenizer
        self._store: GrammarStore | None = None
        self._lock = threading.Lock()  # compiles run on the grammar service's worker thread

    @property
    def store(self) -> GrammarStore:
        with self._lock:
            if self._store is None:
                self._store = GrammarStore(self.backend, self._version(), self._tokenizer)
            return self._store

    def has(self, constraint: Any) -> bool:
        return self.store.has(constraint)

    def save(self, constraint: Any, data: bytes) -> Path:
        return self.store.save(constraint, data)

    def load(self, constraint: Any, decode: Callable[[bytes], T]) -> T | None:
        """`decode` of what fw warm-cache kept for `constraint`, or None (nothing kept, or unreadable)."""
        if not store_in_use(self.backend):  # nothing was ever warmed: skip hashing the vocabulary
            return None
        data = self.store.load(constraint)
        if not data:
            return None
        try:
            return decode(data)
        except Exception as exc:  # noqa: BLE001 - any failure to read it back means: compile instead
            logger.warning("%s: ignoring the kept compiled form of %s (%s); compiling it", self.backend,
                           constraint.describe(), exc)
            return None

    @staticmethod
    def size_text(n: int) -> str:
        """A kept entry's size for a backend's report line: 12345 -> '12.3 kB'."""
        return size_text(n)


def size_text(n: int) -> str:
    """12345 -> '12.3 kB', for report lines (also `KeptGrammars.size_text`)."""
    return f"{n} B" if n < 1000 else f"{n / 1e3:.1f} kB" if n < 1e6 else f"{n / 1e6:.1f} MB"


def store_in_use(backend: str) -> bool:
    """Whether anything was ever warmed for `backend` (servers skip hashing the vocabulary otherwise)."""
    return store_root(backend).is_dir()
