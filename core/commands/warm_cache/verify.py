"""Checks that a model's files are whole before a server relies on them: every
safetensors header readable and consistent with the file's size, the sharded
index's files present and its total size matching, sizes matching the hub's
listing for a downloaded snapshot, a GGUF file readable.

Why: an interrupted copy or a corrupted cache otherwise surfaces as a crash in
the middle of loading weights (or as wrong numbers); here it is one message
naming the file, at warm-up time. Reading headers only keeps it fast (a few
kilobytes per file, no hashing of gigabytes)."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from fw.errors import ModelLoadError
from fw.model.gguf_header import GGUFHeader

# Bytes per element of the safetensors dtypes; sub-byte and unknown dtypes are not size-checked.
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8,
}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit


@dataclass
class Verified:
    """What was checked: the number of files and their total size."""

    files: int
    bytes: int

    def describe(self) -> str:
        return f"{self.files} files, {_size(self.bytes)}, verified"


def verify_directory(path: Path, expected_sizes: dict[str, int] | None = None) -> Verified:
    """Check a model directory (`expected_sizes`: file name -> size the hub lists for it)."""
    files = sorted(p for p in path.rglob("*") if p.is_file() or p.is_symlink())
    for file in files:
        if not file.exists():  # a dangling symlink: the HF cache lost its blob
            raise _bad(file, "the file is missing (a dangling link into the HF cache)")
    for name, size in sorted((expected_sizes or {}).items()):
        file = path / name
        if file.exists() and file.stat().st_size != size:
            raise _bad(file, f"it has {file.stat().st_size} bytes but the hub lists {size}")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        _check_index(index)
    for file in files:
        if file.suffix == ".safetensors":
            check_safetensors(file)
    return Verified(len(files), sum(f.stat().st_size for f in files))


def verify_gguf(path: Path) -> Verified:
    """A GGUF file whose metadata and tensor table read, with every tensor inside the file."""
    try:
        reader = GGUFHeader(path)
        size = path.stat().st_size
        for t in reader.tensors:
            if t.data_offset + t.n_bytes > size:
                raise ValueError(f"tensor {t.name} ends past the end of the file")
    except Exception as exc:
        raise _bad(path, f"not a readable GGUF file ({exc})") from None
    return Verified(1, path.stat().st_size)


def check_safetensors(file: Path) -> int:
    """Validate one safetensors file's header against its size; returns the tensors' byte total."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _bad(file, f"the file has {size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise _bad(file, f"the header length field says {n} bytes but the file has {size}")
        raw = f.read(n)
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("not a JSON object")
    except (ValueError, UnicodeDecodeError) as exc:
        raise _bad(file, f"the safetensors header is not readable JSON ({exc})") from None
    end, total = 0, 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, stop = (int(x) for x in info["data_offsets"])
            shape = [int(d) for d in info["shape"]]
            dtype = str(info["dtype"])
        except (KeyError, TypeError, ValueError):
            raise _bad(file, f"tensor {name!r} has no valid dtype/shape/data_offsets in the header") from None
        if not 0 <= begin <= stop:
            raise _bad(file, f"tensor {name!r} has data offsets {begin}..{stop}")
        width = DTYPE_BYTES.get(dtype)
        if width is not None and (stop - begin) != math.prod(shape) * width:
            raise _bad(file, f"tensor {name!r} ({dtype} {shape}) should take {math.prod(shape) * width} bytes "
                             f"but its offsets span {stop - begin}")
        end = max(end, stop)
        total += stop - begin
    if 8 + n + end != size:
        raise _bad(file, f"the header describes {8 + n + end} bytes but the file has {size} "
                         f"({'truncated' if size < 8 + n + end else 'trailing bytes'})")
    return total


def _check_index(index: Path) -> None:
    try:
        data = json.loads(index.read_text())
        weight_map = data["weight_map"]
    except (ValueError, KeyError, TypeError) as exc:
        raise _bad(index, f"not a readable safetensors index ({exc})") from None
    shards = sorted(set(weight_map.values()))
    missing = [s for s in shards if not (index.parent / s).is_file()]
    if missing:
        raise _bad(index, f"it lists {len(shards)} shard files but {', '.join(missing[:3])} "
                          f"{'is' if len(missing) == 1 else 'are'} missing")
    declared = (data.get("metadata") or {}).get("total_size")
    if declared is not None:
        actual = sum(check_safetensors(index.parent / s) for s in shards)
        # total_size counts tensor bytes; writers disagree on whether shared tensors count twice
        if actual < int(declared):
            raise _bad(index, f"metadata.total_size is {declared} bytes but the shards hold {actual}")


def _bad(file: Path, why: str) -> ModelLoadError:
    return ModelLoadError(f"{file}: {why}. The file is damaged or incomplete: download it again "
                          f"(fw warm-cache --force-download for a hub model)")


def _size(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"
