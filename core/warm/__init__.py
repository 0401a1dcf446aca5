"""`fw warm-cache`: what serving needs, prepared ahead (downloads, compiled kernels,
compiled model steps, precompiled grammars), with a hit/miss report.

For plugins: implement the `fw_warm_cache_artifacts(context, add)` hook and add
`WarmArtifact`s; `CppOpsArtifact` (a fw.kernels.loader build) and `GrammarWarmArtifact`
(a grammar backend's precompiled --warm-schemas) are ready-made ones, and
`fw.warm.resolve` tells what the server would pick for the context's flags.
`fw.warm.startup` records the phases of an engine's start-up."""

import importlib
from typing import Any

from fw.warm.artifact import WarmArtifact, WarmContext, WarmItem

__all__ = ["WarmArtifact", "WarmContext", "WarmItem", "CppOpsArtifact", "GrammarWarmArtifact"]

_LAZY = {"CppOpsArtifact": "fw.warm.cpp", "GrammarWarmArtifact": "fw.warm.grammar"}


def __getattr__(name: str) -> Any:  # the ready-made artifacts import torch: only when asked for
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fw.warm' has no attribute {name!r}")
