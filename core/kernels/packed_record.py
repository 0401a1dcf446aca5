"""Repacked weights recorded once in fw's cache and read back on later loads.

Why: repacking a quantized checkpoint's blocks into the packed-int kernels' layout is most of a warm
start's `load weights` (docs/performance.md, start-up), and for the same bytes and the same layout
code the result is always the same. A record is keyed by a SHA-256 of the source bytes, the
caller's description of them (the row groups and their formats), and the text of the code that
defines the layout (packed_int.py, packed_int.cpp and the caller's module), so a change to the
weights or to any of that code makes a new record. The bytes are read straight into the
huge-page weight arena (fw.kernels.weight_arena)."""

from __future__ import annotations

import hashlib
import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Callable

import torch

from fw.kernels import weight_arena
from fw.kernels.packed_int import PackedWeight
from fw.paths import cache_dir

KIND = "packed-weights"
_LAYOUT_FILES = (Path(__file__).with_name("packed_int.py"), Path(__file__).with_name("packed_int.cpp"))


@lru_cache(maxsize=8)
def _code_fingerprint(files: tuple[str, ...]) -> str:
    digest = hashlib.sha256()
    for f in (*_LAYOUT_FILES, *map(Path, files)):
        digest.update(f.read_bytes())
    return digest.hexdigest()


def record_key(source: torch.Tensor, description: str, code: tuple[str, ...]) -> str:
    digest = hashlib.sha256(_code_fingerprint(code).encode())
    digest.update(description.encode())
    digest.update(memoryview(source.contiguous().view(torch.uint8).reshape(-1).numpy()))
    return digest.hexdigest()[:32]


def load_or_pack(source: torch.Tensor, description: str, pack: Callable[[], tuple[torch.Tensor, list[PackedWeight]]],
                 code: tuple[str, ...] = ()) -> tuple[torch.Tensor, list[PackedWeight]]:
    """(flat arena tensor, weights as views of it), as `pack()` makes them from `source` (a CPU tensor);
    read from the record of an earlier `pack()` of the same bytes when there is one, else made and
    recorded. `code`: the files of the caller's own layout code (its module's __file__)."""
    key = record_key(source, description, code)
    meta_path = cache_dir() / KIND / (key + ".json")
    found = _read(meta_path)
    if found is not None:
        return found
    flat, packed = pack()
    try:
        _write(meta_path, flat, packed)
    except OSError:  # a read-only or full cache: the next load packs again
        pass
    return flat, packed


def _read(meta_path: Path) -> tuple[torch.Tensor, list[PackedWeight]] | None:
    try:
        meta = json.loads(meta_path.read_text())
        flat = weight_arena.take(meta["nbytes"])
        with open(meta_path.with_suffix(".bin"), "rb") as f:
            if f.readinto(memoryview(flat.numpy())) != meta["nbytes"]:
                return None
    except (OSError, ValueError, KeyError):
        return None
    weights = [PackedWeight(w["bits"], w["rows"], w["cols"], flat[w["offset"]:w["offset"] + w["nbytes"]])
               for w in meta["weights"]]
    return flat, weights


def _write(meta_path: Path, flat: torch.Tensor, packed: list[PackedWeight]) -> None:
    base = flat.data_ptr()
    weights = [{"bits": w.bits, "rows": w.rows, "cols": w.cols, "offset": w.data.data_ptr() - base,
                "nbytes": w.data.numel()} for w in packed]
    meta_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = meta_path.with_suffix(f".{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(memoryview(flat.contiguous().numpy()))
    os.replace(tmp, meta_path.with_suffix(".bin"))
    tmp.write_text(json.dumps({"nbytes": flat.numel(), "weights": weights}))
    os.replace(tmp, meta_path)  # last: its presence means a whole record
