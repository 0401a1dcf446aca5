"""Config, tokenizer and safetensors weights of a Hugging Face model directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch

from fw.errors import ModelLoadError


def load_hf_config(path: Path, trust_remote_code: bool, revision: str | None = None):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code, revision=revision)
    except ValueError as exc:
        if "trust_remote_code" in str(exc):
            raise ModelLoadError(f"{path}/config.json needs custom code: pass --trust-remote-code if you trust it") from None
        raise ModelLoadError(f"{path}/config.json could not be read: {exc}") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}/config.json could not be read: {exc}") from None


def load_tokenizer(path: Path | str, trust_remote_code: bool, revision: str | None = None):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code, revision=revision)
    except Exception as exc:
        raise ModelLoadError(
            f"{path}: no usable tokenizer ({type(exc).__name__}: {exc}). The directory needs tokenizer.json "
            f"or tokenizer_config.json; pass --tokenizer to use another."
        ) from None


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ModelLoadError(f"{index} is corrupt: {exc}") from None
        files = [path / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{f} is listed in {index.name} but missing")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weights found")
    return files


def iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of every shard, memory-mapped."""
    from safetensors import SafetensorError, safe_open

    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"{file} is not a readable safetensors file: {exc}") from None
