"""Choosing an implementation, with the reasons every other candidate was rejected."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from fw.errors import UnknownImplementationError, UnsupportedConfigurationError
from fw.plugins.registry import Registry
from fw.plugins.specs import (AttentionBackendSpec, AttentionRequirements, GrammarBackendSpec, MoeKernelSpec,
                             MoeRequirements)

logger = logging.getLogger("fw.plugins")


@dataclass
class Selection:
    chosen: Any
    rejected: dict[str, list[str]] = field(default_factory=dict)
    explicit: bool = False


def _select_by_priority(registry: Registry, req: Any, name: str | None,
                        refused: Callable[[str, str, str], str], none_usable: Callable[[str], str],
                        rank: Callable[[Any], int] = lambda spec: spec.priority) -> Selection:
    """The named implementation if it can run, else the highest-ranked one that can.

    `refused(name, reasons, working)` words the error for an explicit name that cannot run,
    `none_usable(detail)` the error when nothing can; `rank(spec)` is its priority (by default
    `spec.priority`)."""
    rejected = {spec.name: spec.rejection_reasons(req) for spec in registry}
    usable = sorted((s for s in registry if not rejected[s.name]), key=lambda s: (-rank(s), s.name))
    rejected = {n: r for n, r in rejected.items() if r}
    if name is not None and name != "auto":
        spec = registry.get(name)
        if rejected.get(name):
            working = ", ".join(s.name for s in usable) or "none"
            raise UnsupportedConfigurationError(refused(name, "; ".join(rejected[name]), working))
        return Selection(spec, rejected, explicit=True)
    if not usable:
        detail = "; ".join(f"{n}: {', '.join(r)}" for n, r in sorted(rejected.items())) or "none installed"
        raise UnsupportedConfigurationError(none_usable(detail))
    return Selection(usable[0], rejected)


def select_attention_backend(
    registry: Registry[AttentionBackendSpec], req: AttentionRequirements, name: str | None = None
) -> Selection:
    """The named backend if it can run, else the one with the highest priority on `req.device`
    (`AttentionBackendSpec.priority_on`) that can. An explicit name that cannot run is an error
    listing its reasons and the names that would work."""
    return _select_by_priority(
        registry, req, name, rank=lambda spec: spec.priority_on(req.device),
        refused=lambda n, why, working: (f"attention backend {n!r} cannot run this model here: {why}. "
                                         f"Backends that would work: {working}."),
        none_usable=lambda detail: (f"no attention backend can run this model on {req.device} with {req.dtype} "
                                    f"(head size {req.head_size}): {detail}"),
    )


def select_moe_kernel(registry: Registry[MoeKernelSpec], req: MoeRequirements, name: str | None = None) -> Selection:
    """The named MoE kernel if it can run, else the highest-priority one that can (as for attention)."""
    return _select_by_priority(
        registry, req, name,
        refused=lambda n, why, working: (f"MoE kernel {n!r} cannot run this model here: {why}. "
                                         f"Pass --moe-backend with one that would work: {working} (or auto)."),
        none_usable=lambda detail: (
            f"no MoE kernel can run this model on {req.device} with {req.dtype} "
            f"({req.num_experts} experts, activation {req.activation}): {detail}. "
            f"Install a moe_kernel plugin that can (`fw plugins list --kind moe_kernel` shows what is installed)."),
    )


class MoeKernelChooser:
    """Picks the MoE kernel when the first MoE layer is built (its requirements are known only
    then), so a dense model never needs one. An unknown `--moe-backend` name fails at once.

    The loader puts one in `ModelContext.extra["moe_kernel"]`; `selection` is the last choice."""

    def __init__(self, registry: Registry[MoeKernelSpec], name: str | None = None):
        self.registry = registry
        self.name = None if name in (None, "auto") else name
        if self.name is not None and self.name not in registry:
            raise UnknownImplementationError(
                f"--moe-backend {self.name}: no MoE kernel of that name; choose auto or one of: "
                f"{', '.join(registry.names()) or '(none installed)'}. "
                f"`fw plugins list --kind moe_kernel` shows what is installed."
            )
        self.selection: Selection | None = None
        self._chosen: dict[MoeRequirements, Selection] = {}

    def __call__(self, req: MoeRequirements) -> Any:
        """A new kernel instance for one MoE layer with requirements `req`."""
        if req not in self._chosen:
            self._chosen[req] = select_moe_kernel(self.registry, req, self.name)
            logger.info("MoE kernel %s for %d experts, top-%d, %s", self._chosen[req].chosen.name,
                        req.num_experts, req.top_k, req.dtype)
        self.selection = self._chosen[req]
        return self.selection.chosen.kernel_cls()


def select_grammar_backend(registry: Registry[GrammarBackendSpec], constraint_kind: str,
                           name: str | None = None) -> Selection:
    """The named grammar backend if it compiles this kind of constraint here, else the
    highest-priority one that does."""
    return _select_by_priority(
        registry, constraint_kind, name,
        refused=lambda n, why, working: (f"grammar backend {n!r} cannot take this request: {why}. "
                                         f"Backends that would: {working}."),
        none_usable=lambda detail: (f"no grammar backend can compile a {constraint_kind} constraint: {detail}. "
                                    f"Install one: pip install xgrammar outlines-core"),
    )
