"""Repacked GGUF weights recorded in fw's cache (fw.kernels.packed_record, issue 19's start-up): a second
load reads the record instead of repacking, and gets the same bytes, the same layer outputs and the same
tokens; changed weights or a changed layout description make a new record."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

import gguf_models
from conftest import make_llm
from fw import SamplingParams
from fw.kernels import packed_int, packed_record
from fw.layers.linear import Linear

needs_kernels = pytest.mark.skipif(not packed_int.wanted() or not packed_int.ready(),
                                   reason="no AVX512-VNNI CPU or no C++ toolchain")


def _load(path: Path, tokenizer_dir: Path):
    llm = make_llm(path, tokenizer=str(tokenizer_dir), gguf_dequantize_at_load=False)
    layers = {n: m for n, m in llm.engine.loaded.model.named_modules() if isinstance(m, Linear)}
    tokens = llm.generate(["Hello world, once upon a time"], SamplingParams(temperature=0, max_tokens=8,
                                                                           ignore_eos=True))[0].outputs[0].token_ids
    return layers, tokens


@needs_kernels
def test_a_second_load_reads_the_record_and_runs_the_same(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setenv("FW_CPU_PACKED_INT", "1")
    monkeypatch.setenv("FW_CACHE_DIR", str(tmp_path / "cache"))
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    path = gguf_models.write_tiny_llama_gguf(tmp_path / "tiny.gguf", T.Q4_1, tokenizer,
                                             overrides={"mlp.up_proj": T.Q8_0}).path  # a fused layer of two formats
    packs = []
    real_pack = packed_int.pack
    monkeypatch.setattr(packed_int, "pack", lambda blocks: packs.append(1) or real_pack(blocks))
    first, first_tokens = _load(path, tmp_path / "tokenizer")
    assert packs and len(list((tmp_path / "cache" / packed_record.KIND).glob("*.json"))) == len(first)
    packs.clear()
    second, second_tokens = _load(path, tmp_path / "tokenizer")
    assert packs == [], "a recorded layer was repacked"
    assert second_tokens == first_tokens
    torch.manual_seed(0)
    for name, layer in second.items():
        before = first[name]
        assert [(w.bits, w.rows, w.cols) for w in layer.packed_int] == \
            [(w.bits, w.rows, w.cols) for w in before.packed_int], name
        assert all(torch.equal(a.data, b.data) for a, b in zip(layer.packed_int, before.packed_int)), name
        x = torch.randn(3, layer.input_size)
        assert torch.equal(layer(x), before(x)), name


def test_the_key_follows_the_bytes_the_description_and_the_code():
    source = torch.arange(256, dtype=torch.uint8)
    key = packed_record.record_key(source, "[(3, 8, 0, 20)]", ())
    assert packed_record.record_key(source.clone(), "[(3, 8, 0, 20)]", ()) == key
    changed = source.clone()
    changed[7] += 1
    assert packed_record.record_key(changed, "[(3, 8, 0, 20)]", ()) != key
    assert packed_record.record_key(source, "[(2, 8, 0, 20)]", ()) != key
    assert packed_record.record_key(source, "[(3, 8, 0, 20)]", (packed_int.__file__,)) != key


def test_a_damaged_record_is_packed_again(tmp_path, monkeypatch):
    monkeypatch.setenv("FW_CACHE_DIR", str(tmp_path))
    source = torch.arange(128, dtype=torch.uint8)

    def pack():
        data = torch.arange(64, dtype=torch.uint8)
        return data, [packed_int.PackedWeight(4, 2, 64, data)]

    flat, weights = packed_record.load_or_pack(source, "d", pack)
    record = next((tmp_path / packed_record.KIND).glob("*.bin"))
    flat2, weights2 = packed_record.load_or_pack(source, "d", lambda: pytest.fail("packed again"))
    assert torch.equal(flat2, flat) and [(w.bits, w.rows, w.cols) for w in weights2] == [(4, 2, 64)]
    record.write_bytes(b"short")
    calls = []
    flat3, _ = packed_record.load_or_pack(source, "d", lambda: calls.append(1) or pack())
    assert calls == [1] and torch.equal(flat3, flat)
