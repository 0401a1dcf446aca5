"""Resolve `--model` to files on disk: a directory, a `.gguf` file, or a hub id
through huggingface_hub's cache (offline works once cached)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from fw.errors import ModelLoadError

HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt"]


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "directory" | "gguf"
    path: Path  # the directory, or the .gguf file
    name: str  # what the user called it (served model name by default)
    revision: str | None = None


def resolve_model(model: str, revision: str | None = None) -> ModelSource:
    local = local_source(model)
    if local is not None:
        return local
    return ModelSource("directory", _download(model, revision), model, revision)


def local_source(model: str) -> ModelSource | None:
    """`model` as a local directory or .gguf file; None when it names a hub id instead. Raises
    ModelLoadError for a path that cannot be a model."""
    if not model:
        raise ModelLoadError("no model given: pass --model DIR, a .gguf file, or a Hugging Face hub id")
    path = Path(os.path.expanduser(model))
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{path}: a model file must be a .gguf file; for safetensors pass the directory")
        return ModelSource("gguf", path.resolve(), model)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path}: the directory has no config.json; is it a Hugging Face model directory?")
        return ModelSource("directory", path.resolve(), model)
    if model.endswith(".gguf") or model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise ModelLoadError(f"{model}: no such file or directory")
    return None


def cached_snapshot(repo_id: str, revision: str | None) -> Path | None:
    """The complete snapshot of `repo_id` at `revision` in the local HF cache, or None (nothing
    touches the network)."""
    # here: huggingface_hub costs start-up time; a local model never needs it
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError  # here: as above

    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_PATTERNS, local_files_only=True))
    except LocalEntryNotFoundError:
        return None
    except Exception as exc:  # bad repo id syntax and the like
        raise ModelLoadError(f"{repo_id}: not a model directory, .gguf file or hub id ({exc})") from None


def download_snapshot(repo_id: str, revision: str | None, force_download: bool = False) -> Path:
    """Resolve `revision` on the hub and fetch what the HF cache lacks (everything with
    `force_download`), with huggingface_hub's progress bars; offline, the cached snapshot."""
    # here: huggingface_hub costs start-up time; a local model never needs it
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_PATTERNS,
                                      force_download=force_download))
    except Exception as exc:
        raise ModelLoadError(
            f"{repo_id}: not found locally and could not be downloaded ({type(exc).__name__}: {exc}). "
            f"Check the id and --revision (and HF_ENDPOINT, or HF_TOKEN for a private or gated repo)."
        ) from None


def _download(repo_id: str, revision: str | None) -> Path:
    """The snapshot from the local HF cache if present, else from the hub."""
    return cached_snapshot(repo_id, revision) or download_snapshot(repo_id, revision)
