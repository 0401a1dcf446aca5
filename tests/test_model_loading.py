"""Model sources and their failures: hub ids through the offline HF cache,
sharded safetensors, and clear errors naming the file that is wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import make_llm
from fw import SamplingParams
from fw.errors import ModelLoadError, UnsupportedArchitectureError

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPT = "The quick brown fox"


def _greedy(llm) -> list[int]:
    return llm.generate(PROMPT, GREEDY)[0].outputs[0].token_ids


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_hub_id_resolves_from_the_offline_cache(gqa_dir, tmp_path, monkeypatch) -> None:
    import huggingface_hub.constants as hf_constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--fwtest--tiny-llama"
    _copy(gqa_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    expected = _greedy(make_llm(gqa_dir))
    assert _greedy(make_llm("fwtest/tiny-llama")) == expected
    assert _greedy(make_llm("fwtest/tiny-llama", revision=commit)) == expected


def test_unknown_hub_id_offline_says_how_to_get_it(tmp_path, monkeypatch) -> None:
    import huggingface_hub.constants as hf_constants

    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match="fwtest/absent"):
        make_llm("fwtest/absent")


def test_sharded_checkpoint_loads_like_the_single_file(gqa_dir, tmp_path) -> None:
    from transformers import LlamaForCausalLM

    sharded = tmp_path / "sharded"
    LlamaForCausalLM.from_pretrained(gqa_dir).save_pretrained(sharded, max_shard_size="100KB")
    for f in gqa_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            shutil.copy(f, sharded / f.name)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    assert _greedy(make_llm(sharded)) == _greedy(make_llm(gqa_dir))


def test_missing_shard_is_named(gqa_dir, tmp_path) -> None:
    broken = _copy(gqa_dir, tmp_path / "m")
    index = {"metadata": {}, "weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors"):
        make_llm(broken)


def test_corrupt_safetensors_is_named(gqa_dir, tmp_path) -> None:
    broken = _copy(gqa_dir, tmp_path / "c")
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        make_llm(broken)


def test_missing_weights_are_listed(gqa_dir, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    broken = _copy(gqa_dir, tmp_path / "w")
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.0.mlp.down_proj.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="down_proj"):
        make_llm(broken)


def test_directory_without_config_or_path_that_does_not_exist(tmp_path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        make_llm(tmp_path / "empty")
    with pytest.raises(ModelLoadError, match="no such file"):
        make_llm(tmp_path / "nothing" / "model.gguf")


def test_corrupt_gguf_is_named(tmp_path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="bad.gguf"):
        make_llm(bad)


def test_unknown_architecture_lists_the_supported_ones(gqa_dir, tmp_path) -> None:
    other = _copy(gqa_dir, tmp_path / "u")
    config = json.loads((other / "config.json").read_text())
    config["architectures"] = ["FrobnicatorForCausalLM"]
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match="LlamaForCausalLM"):
        make_llm(other)


def test_loading_initialises_no_weight_at_random(gqa_dir, monkeypatch) -> None:
    """Every weight comes from the checkpoint: a random initialisation first (nn.Embedding's own, say) is
    start-up time for nothing."""
    import torch

    def refused(*args, **kwargs):
        raise AssertionError("a weight was initialised at random while loading")

    for name in ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "xavier_uniform_"):
        monkeypatch.setattr(torch.nn.init, name, refused)
    llm = make_llm(gqa_dir)
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0))[0].outputs[0].token_ids
