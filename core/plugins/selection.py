"""Choosing an implementation, with the reasons every other candidate was rejected."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from fw.devices import describe
from fw.errors import UnknownImplementationError, UnsupportedConfigurationError
from fw.plugins.registry import Registry
from fw.plugins.specs import (AttentionBackendSpec, AttentionRequirements, GrammarBackendSpec, MoeKernelSpec,
                             MoeRequirements, Verified, verification)

logger = logging.getLogger("fw.plugins")


@dataclass
class Selection:
    """One choice among a kind's candidates and everything said about it: the reasons each rejected
    candidate cannot run, why auto passed over each usable one it did not choose, the device kinds the
    chosen one was verified on, and the warning to log when it was not verified on this GPU."""

    chosen: Any
    rejected: dict[str, list[str]] = field(default_factory=dict)
    explicit: bool = False
    passed_over: dict[str, str] = field(default_factory=dict)  # usable but not chosen by auto: why
    verified: Verified | None = None  # the chosen one's record for this device kind, if any
    warning: str | None = None  # the chosen one runs unverified on this GPU: log it once


def prefers_verified(device: str) -> bool:
    """Off the CPU, auto takes a candidate verified on the device's kind over a faster unverified one.
    On the CPU every built-in is verified by the test suite, and ranking stays by priority alone."""
    return device != "cpu"


def unverified_warning(what: str, spec: Any, device: str, capability: tuple[int, int] | None, why_chosen: str,
                       verified_here: list[str] = ()) -> str | None:
    """The one-line warning for running `spec` where it has not been verified, or None (verified, or CPU)."""
    if not prefers_verified(device) or verification(spec, device, capability) is not None:
        return None
    kind = describe(device, capability)
    elsewhere = ", ".join(str(v) for v in getattr(spec, "verified_on", ())) or "nowhere yet"
    text = (f"{what} {spec.name!r} has not been verified on {kind} (no GPU acceptance run of its tests has passed "
            f"on this kind of device; verified on: {elsewhere}); it runs because {why_chosen}")
    if verified_here:
        text += f". Verified here: {', '.join(verified_here)}"
    return text + "."


def selection_rank(spec: Any, device: str) -> int:
    """The priority auto ranks `spec` by: an attention backend's priority on `device`, else its priority."""
    priority_on = getattr(spec, "priority_on", None)
    return priority_on(device) if priority_on is not None else spec.priority


def _select_by_priority(registry: Registry, req: Any, name: str | None,
                        refused: Callable[[str, str, str], str], none_usable: Callable[[str], str],
                        what: str = "implementation", flag: str = "its option") -> Selection:
    """The named implementation if it can run, else the best-ranked one that can.

    Best: off the CPU, verified on the device's kind (`Verified`) before unverified; then the higher
    `selection_rank`; then the name. `refused(name, reasons, working)` words the
    error for an explicit name that cannot run, `none_usable(detail)` the error when nothing can; `what`
    and `flag` word the warning for a chosen candidate that runs unverified."""
    device, capability = getattr(req, "device", "cpu"), getattr(req, "capability", None)
    rank = functools.partial(selection_rank, device=device)
    prefer = prefers_verified(device)
    verified = {spec.name: verification(spec, device, capability) for spec in registry}
    rejected = {spec.name: spec.rejection_reasons(req) for spec in registry}
    usable = sorted((s for s in registry if not rejected[s.name]),
                    key=lambda s: (prefer and verified[s.name] is None, -rank(s), s.name))
    rejected = {n: r for n, r in rejected.items() if r}
    verified_usable = [s.name for s in usable if verified[s.name] is not None]
    if name is not None and name != "auto":
        spec = registry.get(name)
        if rejected.get(name):
            working = ", ".join(s.name for s in usable) or "none"
            raise UnsupportedConfigurationError(refused(name, "; ".join(rejected[name]), working))
        warning = unverified_warning(what, spec, device, capability, f"{flag} names it", verified_usable)
        return Selection(spec, rejected, explicit=True, verified=verified[name], warning=warning)
    if not usable:
        detail = "; ".join(f"{n}: {', '.join(r)}" for n, r in sorted(rejected.items())) or "none installed"
        raise UnsupportedConfigurationError(none_usable(detail))
    chosen = usable[0]
    kind = describe(device, capability)
    passed_over = {}
    for spec in usable[1:]:
        if prefer and verified[spec.name] is None and verified[chosen.name] is not None:
            faster = rank(spec) > rank(chosen)
            passed_over[spec.name] = (f"not verified on {kind}: auto prefers {chosen.name}, verified there"
                                      + (f", over its higher priority ({rank(spec)} > {rank(chosen)})"
                                         if faster else ""))
        else:
            passed_over[spec.name] = f"lower priority than {chosen.name}"
    warning = unverified_warning(what, chosen, device, capability,
                                 f"auto found no {what} verified there and took the highest priority")
    return Selection(chosen, rejected, passed_over=passed_over, verified=verified[chosen.name], warning=warning)


def select_attention_backend(
    registry: Registry[AttentionBackendSpec], req: AttentionRequirements, name: str | None = None
) -> Selection:
    """The named backend if it can run, else the one with the highest priority on `req.device`
    (`AttentionBackendSpec.priority_on`) that can, verified ones first off the CPU. An explicit name
    that cannot run is an error listing its reasons and the names that would work."""
    return _select_by_priority(
        registry, req, name, what="attention backend", flag="--attention-backend",
        refused=lambda n, why, working: (f"attention backend {n!r} cannot run this model here: {why}. "
                                         f"Backends that would work: {working}."),
        none_usable=lambda detail: (f"no attention backend can run this model on {req.device} with {req.dtype} "
                                    f"(head size {req.head_size}): {detail}"),
    )


def select_moe_kernel(registry: Registry[MoeKernelSpec], req: MoeRequirements, name: str | None = None) -> Selection:
    """The named MoE kernel if it can run, else the highest-priority one that can (as for attention)."""
    return _select_by_priority(
        registry, req, name, what="MoE kernel", flag="--moe-backend",
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
            self._chosen[req] = selection = select_moe_kernel(self.registry, req, self.name)
            logger.info("MoE kernel %s for %d experts, top-%d, %s", selection.chosen.name,
                        req.num_experts, req.top_k, req.dtype)
            if selection.warning:
                logger.warning("%s", selection.warning)
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
