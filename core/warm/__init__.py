"""`fw warm-cache`: what serving needs, prepared ahead (downloads, compiled kernels,
compiled model steps, precompiled grammars), with a hit/miss report."""

from fw.warm.artifact import WarmArtifact, WarmContext, WarmItem

__all__ = ["WarmArtifact", "WarmContext", "WarmItem"]
