"""A decoder model's layers replayed from C++ on CPU steps: built once from the layers' `emit_step`, used by
`DecoderModel.forward` instead of its Python loop.

Each layer class that can describes its own forward as the same op calls (`emit_step(b, ...)`, beside its
`forward`, into a fw.kernels.step_program builder); a module that cannot raises `NotReplayable` and the model
keeps its Python forward for good, with the reason logged once. `emit_step` checks that the module's class
did not override the `forward` it mirrors: a subclass with its own forward is never replayed as its parent.

The program holds the KV cache tensors and the linear methods' weights as constants; it is rebuilt when the
runner binds new caches or a layer gets another method (LoRA swaps its methods in for steps with an adapter,
which are not replayed). It is used on CPU only, never while torch.compile traces the forward (the compiled
graph is the other way to leave Python), and `FW_CPU_STEP_PROGRAM=0` turns it off.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from fw.kernels import cpu_ops, step_program
from fw.kernels.step_program import NotReplayable, ProgramBuilder, Reg, emit
from fw.layers.attention import Attention, AttentionBackend
from fw.layers.linear import Linear
from fw.plugins import tracing

logger = logging.getLogger(__name__)

_ATTRIBUTE = "_fw_step_program"  # on the model: a ReplayedLayers, or the reason (str) it has none


@dataclass
class ReplayedLayers:
    """The program of a model's decoder layers, the attention backend that feeds its step inputs, and the
    KV caches and linear methods it was built with."""

    builder: ProgramBuilder
    results: list[Reg]
    backend: type
    attention: list[Attention]
    caches: list[torch.Tensor]
    linears: list[Linear]
    methods: list[object]

    def current(self) -> bool:
        """Whether the model still has what the program was built from: its KV caches (the runner binds
        them) and its linear methods (LoRA swaps them in for the steps that run an adapter)."""
        return (all(a.kv_cache is c for a, c in zip(self.attention, self.caches))
                and all(m.method is method for m, method in zip(self.linears, self.methods)))

    def run(self, x: torch.Tensor, cos_sin, meta) -> tuple[torch.Tensor, torch.Tensor | None]:
        cos, sin = cos_sin
        inputs = [x, cos.squeeze(1), sin.squeeze(1), *self.backend.step_inputs(meta)]
        out = step_program.run(self.builder, inputs, self.results)
        return out[0], (out[1] if len(out) > 1 else None)


def for_step(model: nn.Module, x: torch.Tensor, meta) -> ReplayedLayers | None:
    """The replayed layers for this step of `model` (a DecoderModel), or None to run them in Python."""
    if torch.compiler.is_compiling() or meta is None or not x.is_cpu:
        return None
    state = model.__dict__.get(_ATTRIBUTE)
    if isinstance(state, ReplayedLayers) and state.current():
        return state
    if isinstance(state, str):  # refused for good (a method swapped back later is not worth a rebuild)
        return None
    attention = [m for m in model.modules() if isinstance(m, Attention)]
    if any(a.kv_cache is None for a in attention):  # not bound yet: the runner binds before its first step
        return None
    try:
        state = build(model, attention)
        logger.debug("%s: decoder layers replayed from C++ (%d calls a step)", type(model).__name__,
                     state.builder.instructions())
    except NotReplayable as exc:
        state = str(exc)
        logger.debug("%s: decoder layers run in Python: %s", type(model).__name__, exc)
    except Exception as exc:  # noqa: BLE001  (an emit_step's bug: the Python forward is always right)
        state = f"recording the step program failed: {type(exc).__name__}: {exc}"
        logger.warning("%s: decoder layers run in Python (%s)", type(model).__name__, state)
    model.__dict__[_ATTRIBUTE] = state  # a plain attribute: not a submodule, not part of the state dict
    return state if isinstance(state, ReplayedLayers) else None


def status(model: nn.Module) -> str:
    """"replayed", "not built yet", or why the layers run in Python: for tests and diagnostics."""
    state = model.__dict__.get(_ATTRIBUTE)
    if state is None:
        return "not built yet"
    return "replayed" if isinstance(state, ReplayedLayers) else state


def has_step_program(backend: object) -> bool:
    """Whether layers on this attention backend class can be replayed: an AttentionBackend that overrides
    `emit_step` (torch.compile's stand-in for a backend is not an AttentionBackend at all)."""
    return (isinstance(backend, type) and issubclass(backend, AttentionBackend)
            and backend.emit_step is not AttentionBackend.emit_step)


def build(model: nn.Module, attention: list[Attention]) -> ReplayedLayers:
    """The program of `model.layers`, each layer given (x, residual) and returning them, as in the Python loop."""
    if not step_program.wanted():
        raise NotReplayable("FW_CPU_STEP_PROGRAM=0")
    if not cpu_ops.ready():
        raise NotReplayable("fw's fused CPU ops are not loaded")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if any(tracing.is_traced(obj) for obj in [*(a.impl for a in attention), *(m.method for m in linears)]):
        raise NotReplayable("plugin calls are traced (FW_TRACE_PLUGINS): each is made from Python")
    backends = {type(a.impl) for a in attention}
    if len(backends) != 1:
        raise NotReplayable(f"{len(backends)} attention backends in one model")
    backend = backends.pop()
    if not has_step_program(backend):
        raise NotReplayable(f"attention backend {getattr(backend, '__name__', backend)} has no step program")
    b = ProgramBuilder(("x", "cos", "sin", *backend.step_input_names))
    x, residual = b.input("x"), None
    for layer in model.layers:
        x, residual = emit(layer, b, x, residual)
    results = [x] if residual is None else [x, residual]
    return ReplayedLayers(b, results, backend, attention, [a.kv_cache for a in attention], linears,
                          [m.method for m in linears])
