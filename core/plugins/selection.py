"""Choosing an implementation, with the reasons every other candidate was rejected."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fw.errors import UnsupportedConfigurationError
from fw.plugins.registry import Registry
from fw.plugins.specs import AttentionBackendSpec, AttentionRequirements


@dataclass
class Selection:
    chosen: Any
    rejected: dict[str, list[str]] = field(default_factory=dict)
    explicit: bool = False


def select_attention_backend(
    registry: Registry[AttentionBackendSpec], req: AttentionRequirements, name: str | None = None
) -> Selection:
    """The named backend if it can run, else the highest-priority one that can.

    An explicit name that cannot run is an error listing its reasons and the
    names that would work."""
    rejected = {spec.name: spec.rejection_reasons(req) for spec in registry}
    usable = sorted((s for s in registry if not rejected[s.name]), key=lambda s: (-s.priority, s.name))
    rejected = {n: r for n, r in rejected.items() if r}
    if name is not None and name != "auto":
        spec = registry.get(name)
        if rejected.get(name):
            working = ", ".join(s.name for s in usable) or "none"
            raise UnsupportedConfigurationError(
                f"attention backend {name!r} cannot run this model here: {'; '.join(rejected[name])}. "
                f"Backends that would work: {working}."
            )
        return Selection(spec, rejected, explicit=True)
    if not usable:
        detail = "; ".join(f"{n}: {', '.join(r)}" for n, r in sorted(rejected.items())) or "none installed"
        raise UnsupportedConfigurationError(
            f"no attention backend can run this model on {req.device} with {req.dtype} "
            f"(head size {req.head_size}): {detail}"
        )
    return Selection(usable[0], rejected)
