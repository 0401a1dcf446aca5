"""Warm-cache artifacts for the model itself: its files (downloaded through
huggingface_hub into the normal HF cache, then verified) and, for a GGUF file,
transformers' tokenizer conversion, which fw caches once per file."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from huggingface_hub import constants

from fw.commands.warm_cache.verify import Verified, verify_directory, verify_gguf
from fw.errors import ModelLoadError
from fw.model.derived_cache import entry_dir
from fw.model.fast_tokenizer import SNAPSHOT_FILE
from fw.model.gguf_file import GGUFModel
from fw.model.hf import config_record, load_hf_config, load_tokenizer, tokenizer_record
from fw.model.source import HUB_PATTERNS, ModelSource, cached_snapshot, download_snapshot, local_source
from fw.warm.artifact import WarmContext, WarmItem

try:
    from huggingface_hub._tree_cache import read_tree_cache
    from huggingface_hub.utils import filter_repo_objects
except ImportError:  # another huggingface_hub layout: the safetensors checks still run
    read_tree_cache = filter_repo_objects = None


class ModelFilesArtifact:
    """Sets `context.source` once the files are present and verified (every other artifact needs them)."""

    name = "model files"
    owner = "core"

    def check(self, context: WarmContext) -> list[WarmItem]:
        cfg = context.config
        label = _label(cfg.model, cfg.revision)
        local = local_source(cfg.model)
        path = local.path if local is not None else cached_snapshot(cfg.model, cfg.revision)
        if path is None:
            return [WarmItem(label, False, f"not in the HF cache {_hub_cache()}; would download it from "
                                           f"{_endpoint()}")]
        source = local or ModelSource("directory", path, cfg.model, cfg.revision)
        try:
            verified = verify_source(source)
        except ModelLoadError as exc:
            return [WarmItem(label, False, f"fails verification: {exc}")]
        context.source = source
        return [WarmItem(label, True, f"{path} ({verified.describe()})")]

    def build(self, context: WarmContext) -> list[WarmItem]:
        cfg = context.config
        label = _label(cfg.model, cfg.revision)
        local = local_source(cfg.model)
        if local is not None:
            verified = verify_source(local)
            context.source = local
            return [WarmItem(label, True, f"{local.path} ({verified.describe()}; local, nothing to download)")]
        force = bool(context.options.get("force_download"))
        try:
            before = cached_snapshot(cfg.model, cfg.revision)
        except ModelLoadError:
            before = None
        path = download_snapshot(cfg.model, cfg.revision, force_download=force)
        source = ModelSource("directory", path, cfg.model, cfg.revision)
        verified = verify_source(source)
        context.source = source
        hit = before == path and not force
        return [WarmItem(label, hit, f"{path} ({verified.describe()}{'' if hit else ', downloaded'})")]


class GgufTokenizerArtifact:
    """transformers' conversion of a GGUF file's tokenizer (seconds), kept under fw's cache dir."""

    name = "GGUF tokenizer"
    owner = "core"

    def _gguf(self, context: WarmContext):
        source = context.source
        if source is None or source.kind != "gguf" or context.config.tokenizer:
            return None  # a hub id or directory has its own tokenizer files
        return GGUFModel(source.path)

    def check(self, context: WarmContext) -> list[WarmItem]:
        gguf = self._gguf(context)
        if gguf is None:
            return []
        cached = gguf.tokenizer_cache_dir()
        return [WarmItem(gguf.path.name, (cached / "tokenizer.json").is_file(), str(cached))]

    def build(self, context: WarmContext) -> list[WarmItem]:
        gguf = self._gguf(context)
        if gguf is None:
            return []
        cached = gguf.tokenizer_cache_dir()
        hit = (cached / "tokenizer.json").is_file()
        context.memo["tokenizer"] = gguf.tokenizer()  # converts and stores it when missing
        return [WarmItem(gguf.path.name, hit, str(cached))]


class ModelRecordsArtifact:
    """A model directory's config and tokenizer as transformers reads them, recorded so that a start
    reads them without importing transformers (fw.model.config_snapshot, .fast_tokenizer; a
    GGUF file's are recorded with its tokenizer conversion and the plan's config)."""

    name = "model records"
    owner = "core"

    def _records(self, context: WarmContext) -> list[tuple[str, Path | None, Callable[[], object]]]:
        source, cfg = context.source, context.config
        if source is None or source.kind != "directory":
            return []
        config_key = config_record(source.path, cfg.trust_remote_code)
        tokenizer_from = cfg.tokenizer or source.path
        tokenizer_dir = tokenizer_record(tokenizer_from, cfg.trust_remote_code)
        return [
            ("config", None if config_key is None else entry_dir("configs", config_key + ".json"),
             lambda: load_hf_config(source.path, cfg.trust_remote_code, cfg.revision)),
            ("tokenizer", None if tokenizer_dir is None else tokenizer_dir / SNAPSHOT_FILE,
             lambda: load_tokenizer(tokenizer_from, cfg.trust_remote_code)),
        ]

    def check(self, context: WarmContext) -> list[WarmItem]:
        return [WarmItem(what, record.is_file(), str(record)) for what, record, _ in self._records(context)
                if record is not None]

    def build(self, context: WarmContext) -> list[WarmItem]:
        items = []
        for what, record, load in self._records(context):
            if record is None:
                continue
            hit = record.is_file()
            load()  # records it when missing
            items.append(WarmItem(what, hit, str(record) if record.is_file() else
                                  f"{record.parent}: not recordable (transformers reads it at each start)"))
        return items


def verify_source(source: ModelSource) -> Verified:
    if source.kind == "gguf":
        return verify_gguf(source.path)
    return verify_directory(source.path, hub_sizes(source.path))


def hub_sizes(snapshot: Path) -> dict[str, int] | None:
    """File sizes the hub listed for a snapshot in the HF cache (huggingface_hub keeps the listing
    beside the snapshots), for the files fw downloads; None for other directories."""
    if snapshot.parent.name != "snapshots" or read_tree_cache is None:
        return None
    entries = read_tree_cache(str(snapshot.parent.parent), snapshot.name)
    if not entries:
        return None
    wanted = set(filter_repo_objects(items=entries.keys(), allow_patterns=HUB_PATTERNS))
    return {name: (e.lfs_size if e.lfs_size is not None else e.size) for name, e in entries.items() if name in wanted}


def _label(model: str, revision: str | None) -> str:
    return f"{model}@{revision}" if revision else model


def _endpoint() -> str:
    return constants.ENDPOINT


def _hub_cache() -> str:
    return constants.HF_HUB_CACHE
