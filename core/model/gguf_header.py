"""A GGUF file's metadata and tensor table, read in milliseconds.

Why not `gguf.GGUFReader`: it builds a numpy view for every element of every metadata array, which for
SmolLM2's 49k-token vocabulary (tokens, types, 48k merges) took ~2.3 s of every start. fw needs the
scalars, the arrays' lengths and the tensor table; an array is kept as where it lies in the file and
decoded when asked. The tensors' data are views of one read-only memory map, laid out as GGUFReader
lays them out (quantized types as rows of block bytes), so `gguf.quants.dequantize` takes them as is.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

_MAGIC = 0x46554747  # "GGUF", little-endian
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32, 7: np.bool_,
          10: np.uint64, 11: np.int64, 12: np.float64}


class GGUFFormatError(ValueError):
    pass


@dataclass(frozen=True)
class GGUFArray:
    """An array in the metadata: its item type, length, and where its items start."""

    header: "GGUFHeader"
    item_type: int
    count: int
    offset: int

    def __len__(self) -> int:
        return self.count

    def values(self) -> list:
        if self.item_type in _NUMPY:
            return np.frombuffer(self.header.buffer, _NUMPY[self.item_type], self.count, self.offset).tolist()
        out, offs = [], self.offset
        for _ in range(self.count):
            value, offs = self.header._value(self.item_type, offs)
            out.append(value)
        return out


class GGUFTensor:
    """One entry of the tensor table (`name`, `tensor_type`, `shape` fastest dimension first, as GGUF lists it)
    with its `data` as GGUFReader gives it."""

    def __init__(self, header: "GGUFHeader", name: str, dims: list[int], raw_type: int, offset: int):
        from gguf import GGMLQuantizationType  # here: the header reader stays free of the gguf library (start-up time)

        self._header, self.name, self.offset = header, name, offset
        self.shape = np.array(dims, dtype=np.uint64)
        self.tensor_type = GGMLQuantizationType(raw_type)
        self.n_elements = int(np.prod(dims)) if dims else 1

    @property
    def data_offset(self) -> int:
        """Where the tensor's bytes start in the file."""
        return self._header.data_offset + self.offset

    @property
    def n_bytes(self) -> int:
        from gguf import GGML_QUANT_SIZES  # here: the header reader stays free of the gguf library (start-up time)

        block_size, type_size = GGML_QUANT_SIZES[self.tensor_type]
        return self.n_elements * type_size // block_size

    @cached_property
    def data(self) -> np.ndarray:
        # here: the header reader stays free of the gguf library (start-up time)
        from gguf import GGMLQuantizationType as T
        from gguf.quants import quant_shape_to_byte_shape  # here: as above

        dims = tuple(reversed(self.shape.tolist()))
        plain = {T.F16: np.float16, T.F32: np.float32, T.F64: np.float64, T.I8: np.int8, T.I16: np.int16,
                 T.I32: np.int32, T.I64: np.int64}.get(self.tensor_type)
        if plain is not None:
            return np.frombuffer(self._header.buffer, plain, self.n_elements, self.data_offset).reshape(dims)
        data = np.frombuffer(self._header.buffer, np.uint8, self.n_bytes, self.data_offset)
        return data.reshape(quant_shape_to_byte_shape(dims, self.tensor_type))


class GGUFHeader:
    """`fields` maps each metadata key to its value (an int, float, bool, str, or a `GGUFArray`); `tensors`
    is the tensor table. Raises GGUFFormatError for what is not a GGUF file this reader handles."""

    def __init__(self, path: Path | str):
        with open(path, "rb") as f:
            try:
                self.buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as exc:  # an empty file
                raise GGUFFormatError(str(exc)) from None
        try:
            self._parse()
        except struct.error as exc:
            raise GGUFFormatError(f"the file ends inside its header ({exc})") from None

    def _parse(self) -> None:
        magic, version = struct.unpack_from("<II", self.buffer, 0)
        if magic != _MAGIC:
            raise GGUFFormatError("GGUF magic invalid")
        if version not in (2, 3):
            raise GGUFFormatError(f"GGUF version {version} (or a big-endian file), which fw does not read")
        tensor_count, kv_count = struct.unpack_from("<QQ", self.buffer, 8)
        offs = 24
        self.fields: dict[str, Any] = {}
        for _ in range(kv_count):
            key, offs = self._string(offs)
            (value_type,), offs = struct.unpack_from("<I", self.buffer, offs), offs + 4
            self.fields[key], offs = self._value(value_type, offs)
        entries = []
        for _ in range(tensor_count):
            name, offs = self._string(offs)
            (n_dims,), offs = struct.unpack_from("<I", self.buffer, offs), offs + 4
            dims = list(struct.unpack_from(f"<{n_dims}Q", self.buffer, offs))
            offs += 8 * n_dims
            raw_type, offset = struct.unpack_from("<IQ", self.buffer, offs)
            offs += 12
            entries.append((name, dims, raw_type, offset))
        alignment = self.fields.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFFormatError(f"invalid general.alignment {alignment!r}")
        self.data_offset = offs + (-offs % alignment)
        self.tensors = [GGUFTensor(self, *entry) for entry in entries]
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise GGUFFormatError("duplicated tensor names")

    def _string(self, offs: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", self.buffer, offs)
        end = offs + 8 + length
        if end > len(self.buffer):
            raise GGUFFormatError("a string runs past the end of the file")
        return self.buffer[offs + 8:end].decode("utf-8", errors="replace"), end

    def _value(self, value_type: int, offs: int) -> tuple[Any, int]:
        scalar = _SCALARS.get(value_type)
        if scalar is not None:
            (value,) = struct.unpack_from(scalar, self.buffer, offs)
            return value, offs + struct.calcsize(scalar)
        if value_type == _STRING:
            return self._string(offs)
        if value_type == _ARRAY:
            item_type, count = struct.unpack_from("<IQ", self.buffer, offs)
            start = offs + 12
            return GGUFArray(self, item_type, count, start), self._skip(item_type, count, start)
        raise GGUFFormatError(f"unknown metadata value type {value_type}")

    def _skip(self, item_type: int, count: int, offs: int) -> int:
        """The offset after `count` items of `item_type` starting at `offs`, without decoding them."""
        scalar = _SCALARS.get(item_type)
        if scalar is not None:
            end = offs + count * struct.calcsize(scalar)
        elif item_type == _STRING:
            unpack, buffer = struct.Struct("<Q").unpack_from, self.buffer
            for _ in range(count):
                offs += 8 + unpack(buffer, offs)[0]
            end = offs
        else:  # arrays of arrays: walk them
            for _ in range(count):
                _, offs = self._value(item_type, offs)
            end = offs
        if end > len(self.buffer):
            raise GGUFFormatError("a metadata array runs past the end of the file")
        return end

    def get(self, key: str, default: Any = None) -> Any:
        """A field's value; an array as a list."""
        value = self.fields.get(key, default)
        return value.values() if isinstance(value, GGUFArray) else value
