"""The warm-cache contract: one `WarmArtifact` per thing worth preparing before
serving. The core contributes its own (the model's files, the GGUF tokenizer
conversion, fused C++ ops, compiled model steps); plugins add theirs through
the `fw_warm_cache_artifacts(context, add)` hook (an attention backend's
kernel build, a grammar backend's precompiled schemas). `fw warm-cache`
builds every artifact; `fw warm-cache --check` only asks each one what it has."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass
class WarmItem:
    """One cache entry of an artifact, as `--check` reports it."""

    name: str
    hit: bool
    detail: str = ""  # where it lives, its key, or why it is missing


@dataclass
class WarmContext:
    """What artifacts see: the engine configuration the server would run with (flags, config file,
    environment), the resolved model once its files are present, and options of warm-cache itself."""

    config: Any  # fw.config.EngineConfig
    plugins: Any  # fw.plugins.manager.PluginManager
    source: Any = None  # fw.model.source.ModelSource, after the model artifact ran or hit
    hf_config: Any = None  # the model's transformers config, when known
    options: dict[str, Any] = field(default_factory=dict)  # e.g. {"warm_schemas": Path, "target_device": str}
    # What several artifacts derive from the above (device, dtype, attention backend, grammar tokenizer),
    # worked out once: fw.warm.resolve fills it.
    memo: dict[str, Any] = field(default_factory=dict, repr=False)


@runtime_checkable
class WarmArtifact(Protocol):
    """`name`: shown in reports ("model files", "C++ ops fw_cpu_ops", "torch.compile buckets").
    `owner`: the plugin or core component it comes from. `check()` must be cheap and must not
    build anything; `build()` makes every missing item (and may re-check)."""

    name: str
    owner: str

    def check(self, context: WarmContext) -> list[WarmItem]:
        ...

    def build(self, context: WarmContext) -> list[WarmItem]:
        ...
