"""Programs of op calls that step_program.cpp replays from C++: the builder the layers describe their forward with.

Why: on a small model a CPU decode step is mostly Python between the kernels (docs/performance.md, "Replayed
steps"). A program holds the same op calls the layers' Python forward makes, in the same order with the same
arguments, and `run` makes them through the dispatcher: the numbers are the Python path's to the bit.

A program works on registers: its inputs (named when it is built, passed in that order to `run`), and every
op's returns. `call` takes an op by its qualified name ("namespace::name" or "namespace::name.overload") and
its arguments: registers (`Reg`) or constants (tensors, numbers, lists, None), the op's schema defaults
filled in for the ones left out. `narrow`, `view`, `reshape` and `empty` are the few tensor shapes a layer
needs between calls, made in C++ for the step's own number of rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fw import env
from fw.kernels.loader import DEFAULT_CFLAGS, try_load_cpp_ops

_SOURCE = Path(__file__).with_name("step_program.cpp")  # package data


class NotReplayable(Exception):
    """A module whose forward a program cannot reproduce (its reason is the message); the model then keeps
    running its Python forward."""


class Reg(int):
    """A register of a program under construction: an input, or what an op returned."""


def wanted() -> bool:
    return env.CPU_STEP_PROGRAM.get()


def unavailable() -> str | None:
    """None when the C++ library is loaded (built at install, cached, or built now), else why not."""
    return try_load_cpp_ops("step_program", _SOURCE)


def replays(module: torch.nn.Module, cls: type) -> None:
    """Refuse a module whose class overrides `cls.forward`: its `emit_step` mirrors `cls.forward` only."""
    if type(module).forward is not cls.forward:
        raise NotReplayable(f"{type(module).__name__} overrides {cls.__name__}.forward")


def emit(module: torch.nn.Module, b: ProgramBuilder, *args):
    """`module.emit_step(b, *args)`, refusing a module that has none."""
    emit_step = getattr(module, "emit_step", None)
    if emit_step is None:
        raise NotReplayable(f"{type(module).__name__} has no step program")
    return emit_step(b, *args)


class ProgramBuilder:
    """Records op calls into a C++ program. `inputs`: the names of the tensors `run` will be given, in order."""

    def __init__(self, inputs: Sequence[str]):
        why = unavailable()
        if why is not None:
            raise NotReplayable(f"the step_program library is unavailable ({why})")
        self.program = torch.classes.fw_step.StepProgram(len(inputs))
        self.input_names = tuple(inputs)
        self._inputs = {name: Reg(i) for i, name in enumerate(inputs)}

    def input(self, name: str) -> Reg:
        if name not in self._inputs:
            raise NotReplayable(f"the program has no input {name!r} (its inputs: {', '.join(self.input_names)})")
        return self._inputs[name]

    def call(self, op: str, *args: Any) -> Reg | None:
        """Record `op(*args)`; the register of its first return (an op with several returns fills the next
        registers too), or None when it returns nothing."""
        full = _with_defaults(op, args)
        constants = [None if isinstance(a, Reg) or _empty_list(a) else a for a in full]
        registers = [int(a) if isinstance(a, Reg) else _EMPTY_LIST if _empty_list(a) else -1 for a in full]
        first = self.program.call(op, constants, registers)
        return None if first < 0 else Reg(first)

    def narrow(self, src: Reg, start: int, length: int) -> Reg:
        """Columns [start, start + length) of a 2-D register (a view, as `x[:, start:start + length]`)."""
        return Reg(self.program.narrow(src, start, length))

    def view(self, src: Reg, *dims: int, rows_of: Reg | None = None) -> Reg:
        """`src.view(rows, *dims)`, the rows those of `rows_of` (default: `src`'s own)."""
        return Reg(self.program.view(src, list(dims), -1 if rows_of is None else rows_of))

    def reshape(self, src: Reg, *shape: int) -> Reg:
        """`src.reshape(*shape)`: a view where the strides allow one, else a copy."""
        return Reg(self.program.reshape(src, list(shape)))

    def empty(self, like: Reg, cols: int = -1) -> Reg:
        """A new contiguous tensor of `like`'s dtype: [rows, cols], or `like`'s shape when `cols` is -1."""
        return Reg(self.program.empty(like, cols))

    def instructions(self) -> int:
        return self.program.instructions()


def run(program: ProgramBuilder, inputs: list[torch.Tensor], results: list[Reg]) -> list[torch.Tensor]:
    """Run the recorded calls on `inputs` (in the builder's input order); the tensors in `results`."""
    return torch.ops.fw_step.run(program.program, inputs, [int(r) for r in results])


_EMPTY_LIST = -2  # step_program.cpp's: an empty list (torch cannot type one passed as Any)


def _empty_list(a: Any) -> bool:
    return isinstance(a, (list, tuple)) and len(a) == 0


def _with_defaults(op: str, args: tuple) -> list:
    """`args` followed by the schema's defaults for the arguments left out (None for an optional one)."""
    namespace, _, name = op.partition("::")
    name, _, overload = name.partition(".")
    packet = getattr(getattr(torch.ops, namespace), name)
    schema = getattr(packet, overload or "default")._schema
    params = schema.arguments
    if len(args) > len(params):
        raise TypeError(f"{op} takes {len(params)} arguments, got {len(args)}")
    full = list(args)
    for p in params[len(args):]:
        if p.has_default_value():
            full.append(p.default_value)
        elif isinstance(p.type, torch.OptionalType):
            full.append(None)
        else:
            raise TypeError(f"{op}: argument {p.name!r} has no default; pass it")
    return full
