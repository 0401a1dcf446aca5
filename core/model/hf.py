"""Config, tokenizer and safetensors weights of a Hugging Face model directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from fw.errors import ModelLoadError
from fw.model.config_snapshot import cached_config
from fw.model.derived_cache import entry_dir, entry_key, source_files, write_entry
from fw.model.fast_tokenizer import load_snapshot, save_snapshot, snapshot_supported


def load_hf_config(path: Path, trust_remote_code: bool, revision: str | None = None):
    """The model's config as transformers reads it: built by transformers the first time, then its
    record (fw.model.config_snapshot) while config.json is unchanged; remote code always
    goes through transformers."""
    def build():
        from transformers import AutoConfig  # here: transformers costs start-up time

        try:
            return AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code, revision=revision)
        except ValueError as exc:
            if "trust_remote_code" in str(exc):
                raise ModelLoadError(f"{path}/config.json needs custom code: pass --trust-remote-code if you trust it") from None
            raise ModelLoadError(f"{path}/config.json could not be read: {exc}") from None
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelLoadError(f"{path}/config.json could not be read: {exc}") from None

    record = config_record(Path(path), trust_remote_code)
    return build() if record is None else cached_config("configs", record, build)


def config_record(path: Path, trust_remote_code: bool) -> str | None:
    """The key under which `load_hf_config` records a directory's config (`$FW_CACHE_DIR/configs/<key>.json`),
    or None where it is not recorded (no config.json, remote code)."""
    config_file = path / "config.json"
    if trust_remote_code or not config_file.is_file() or _has_remote_code(config_file):
        return None
    return entry_key("configs", [config_file])


def _has_remote_code(config_file: Path) -> bool:
    """A config.json that maps to custom classes (`auto_map`) is read by transformers each time."""
    try:
        return "auto_map" in json.loads(config_file.read_text())
    except (OSError, ValueError):
        return True  # transformers reports what is wrong with it


def load_tokenizer(path: Path | str, trust_remote_code: bool, revision: str | None = None):
    """The tokenizer of a model directory (or hub id): transformers' the first time, then its snapshot
    loaded with `tokenizers` alone (fw.model.fast_tokenizer) while the directory's files are
    unchanged. Hub ids and remote code always go through transformers."""
    def from_transformers():
        from transformers import AutoTokenizer  # here: transformers costs start-up time

        try:
            return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code, revision=revision)
        except Exception as exc:
            raise ModelLoadError(
                f"{path}: no usable tokenizer ({type(exc).__name__}: {exc}). The directory needs tokenizer.json "
                f"or tokenizer_config.json; pass --tokenizer to use another."
            ) from None

    folder = tokenizer_record(path, trust_remote_code)
    return from_transformers() if folder is None else cached_tokenizer(folder, from_transformers)


def tokenizer_record(path: Path | str, trust_remote_code: bool) -> Path | None:
    """Where `load_tokenizer` records a directory's tokenizer, or None where it is not recorded (a hub id,
    remote code)."""
    local = Path(path).expanduser()
    if trust_remote_code or not local.is_dir():
        return None
    return entry_dir("tokenizers", entry_key("tokenizers", source_files(local)))


def cached_tokenizer(folder: Path, from_transformers: Callable[[], Any], convert: Callable[[], Any] | None = None):
    """The FastTokenizer snapshotted in `folder`, else transformers' tokenizer, snapshotted there when
    FastTokenizer reproduces its class. `convert`: makes the tokenizer from another format (a GGUF
    file's vocabulary) when `folder` lacks its saved files; `from_transformers` then loads it from them."""
    fast = load_snapshot(folder, from_transformers)
    if fast is not None:
        return fast
    if convert is not None and not (folder / "tokenizer.json").is_file():
        converted = convert()
        write_entry(folder, lambda tmp: converted.save_pretrained(str(tmp)))
    if not folder.is_dir():
        folder.mkdir(parents=True, exist_ok=True)
    tok = from_transformers()
    if not snapshot_supported(tok):
        return tok  # a class of its own: transformers on every start
    save_snapshot(tok, folder)
    fast = load_snapshot(folder, from_transformers)
    fast._transformers = tok  # already loaded: delegating costs nothing more
    return fast


def generation_eos_ids(path: Path) -> list[int]:
    """The stop tokens a directory's generation_config.json adds, read as JSON (transformers'
    GenerationConfig keeps `eos_token_id` as written; importing it costs about a second).
    ValueError: the file is not valid JSON or its eos_token_id is not an id or a list of ids."""
    try:
        value = json.loads((path / "generation_config.json").read_text()).get("eos_token_id")
        return [value] if isinstance(value, int) else [int(v) for v in value or []]
    except (OSError, AttributeError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(str(exc)) from None


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
    from safetensors import SafetensorError, safe_open  # here: only reading weights needs it

    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"{file} is not a readable safetensors file: {exc}") from None
