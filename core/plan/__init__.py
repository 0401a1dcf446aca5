"""The engine plan: `resolve(config, plugins) -> EnginePlan` makes every decision the engine takes
before reading a weight (device, dtype, architecture, tokenizer, max length, KV-cache dtype,
attention backend, quantization, MoE kernel) once, with every rejected candidate and why. The
loader, `fw doctor`, `fw warm-cache` and the compile-cache key read the plan; nothing else runs
these selections (tests/test_plan.py checks it). See docs/architecture.md, "The engine plan"."""

from fw.plan.record import Candidate, Decision, EnginePlan, Problem, Resolved
from fw.plan.resolver import resolve

__all__ = ["Candidate", "Decision", "EnginePlan", "Problem", "Resolved", "resolve"]
