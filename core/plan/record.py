"""The engine plan as data: each decision with its candidates and reasons, the values `auto` and
unset options resolved to, and the problems that stop the engine. Frozen, so what doctor prints
and what the engine runs cannot drift apart after resolution."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from fw.errors import FwError

# The decisions that choose among plugins: each has candidates, and is marked skipped when not made.
SELECTIONS = ("architecture", "attention_backend", "quantization_method", "moe_kernel")


@dataclass(frozen=True)
class Candidate:
    """One implementation a decision looked at: chosen, accepted (usable, not chosen) or rejected."""

    name: str
    status: str
    reasons: tuple[str, ...] = ()
    note: str | None = None
    plugin: str | None = None
    distribution: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. priority, verified: shown as they are

    def as_dict(self) -> dict[str, Any]:
        row: dict[str, Any] = {"name": self.name, "plugin": self.plugin, "distribution": self.distribution,
                               "status": self.status, "reasons": list(self.reasons)}
        if self.note:
            row["note"] = self.note
        row.update(self.extra)
        return row


@dataclass(frozen=True)
class Decision:
    """What was decided for one kind (`name`), from the option `option` (None: no option decides it)."""

    name: str
    option: str | None
    requested: Any
    chosen: Any = None
    candidates: tuple[Candidate, ...] = ()
    details: dict[str, Any] = field(default_factory=dict)  # requirements, auto_choice, instead, ...
    warning: str | None = None
    problem: str | None = None
    skipped: str | None = None

    def as_dict(self) -> dict[str, Any]:
        if self.skipped is not None:
            return {"skipped": self.skipped}
        out: dict[str, Any] = {"chosen": _plain(self.chosen)}
        if self.candidates or self.name in SELECTIONS:
            out["candidates"] = [c.as_dict() for c in self.candidates]
        out.update(self.details)
        for key in ("warning", "problem"):
            if getattr(self, key):
                out[key] = getattr(self, key)
        return out


@dataclass(frozen=True)
class Resolved:
    """An `auto` or unset option and what it resolved to, decided by `by` (fw, model, plugin NAME)."""

    option: str
    value: Any
    by: str
    because: str


@dataclass(frozen=True)
class Problem:
    """Why the engine would not start; `error` is what it raises (the first problem's)."""

    decision: str
    message: str
    error: FwError = field(repr=False, compare=False)


@dataclass(frozen=True)
class EnginePlan:
    """Every decision the engine makes before reading a weight. Built by `fw.plan.resolve`; the loader,
    `fw doctor`, `fw warm-cache` and the compile-cache key read it instead of deciding again."""

    source: Any = None  # fw.model.source.ModelSource
    device: torch.device | None = None
    architecture: Any = None  # ArchitectureSpec
    dtype: torch.dtype | None = None
    max_length: int | None = None
    kv_cache_dtype: torch.dtype | None = None
    attention: Any = None  # fw.plugins.selection.Selection
    quantization: str | None = None  # the method's name, None for dense weights
    quant_config: dict[str, Any] | None = None  # what the method's factory reads
    gguf_dequantize_at_load: bool | None = None  # GGUF files only
    moe_kernels: Any = field(default=None, repr=False, compare=False)  # MoeKernelChooser for the build
    decisions: tuple[Decision, ...] = ()
    resolved: tuple[Resolved, ...] = ()
    problems: tuple[Problem, ...] = ()
    hf_config: Any = field(default=None, repr=False, compare=False)
    gguf: Any = field(default=None, repr=False, compare=False)  # fw.model.gguf_file.GGUFModel
    tokenizer: Any = field(default=None, repr=False, compare=False)  # None unless resolved with tokenizer=True

    def decision(self, name: str) -> Decision | None:
        return next((d for d in self.decisions if d.name == name), None)

    def check(self, *names: str) -> None:
        """Raise the engine's error for the first problem (among the decisions `names`, else all)."""
        for problem in self.problems:
            if not names or problem.decision in names:
                raise problem.error

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> dict[str, Any]:
        """The short answer to "what runs this model": `LLM.model_info`."""
        arch = self.decision("architecture")
        chosen = next((c for c in arch.candidates if c.status == "chosen"), None) if arch else None
        moe = self.decision("moe_kernel")
        return {
            "model": self.source.name if self.source is not None else None,
            "architecture": self.architecture.name if self.architecture is not None else None,
            "hf_architectures": list(getattr(self.hf_config, "architectures", None) or []),
            "plugin": chosen.plugin if chosen else None,
            "distribution": chosen.distribution if chosen else None,
            "attention_backend": self.attention.chosen.name if self.attention is not None else None,
            "quantization": self.quantization,
            "moe_kernel": moe.chosen if moe is not None else None,
            "device": _plain(self.device),
            "dtype": _plain(self.dtype),
            "kv_cache_dtype": _plain(self.kv_cache_dtype),
            "max_length": self.max_length,
        }

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: the summary, every decision, the resolved options and the problems."""
        return {
            "summary": self.summary(),
            "decisions": {d.name: {"option": d.option, "requested": _plain(d.requested), **d.as_dict()}
                          for d in self.decisions},
            "resolved": {r.option: {"value": _plain(r.value), "by": r.by, "because": r.because}
                         for r in self.resolved},
            "problems": [{"decision": p.decision, "message": p.message, "error": type(p.error).__name__}
                         for p in self.problems],
        }

    def __str__(self) -> str:
        lines = ["EnginePlan"]
        for d in self.decisions:
            head = f"  {d.name}: " + (f"skipped ({d.skipped})" if d.skipped else str(_plain(d.chosen)))
            lines.append(head)
            for c in d.candidates:
                if c.status != "chosen":
                    why = "; ".join(c.reasons) or c.note or ""
                    lines.append(f"    {c.status} {c.name}" + (f": {why}" if why else ""))
            if d.problem:
                lines.append(f"    PROBLEM: {d.problem}")
        lines += [f"  {r.option} -> {_plain(r.value)} ({r.by}: {r.because})" for r in self.resolved]
        return "\n".join(lines)


def _plain(value: Any) -> Any:
    """torch dtypes and devices as their names (float32, cpu); everything else as it is."""
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, torch.device):
        return str(value)
    return value
