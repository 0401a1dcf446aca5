"""A loaded model's submodules and parameters as plain instance attributes, so that a step's lookups of
`self.qkv_proj` or `layer.weight` skip `nn.Module.__getattr__`.

Why: nn.Module keeps submodules and parameters in dicts that Python reaches only through its slow
`__getattr__` fallback, and a decode step makes hundreds of such lookups a token, which at batch 1 is a
measurable share of the token (docs/performance.md, "Where a batch-1 step goes"). A loaded fw model does
not change its structure (the compiled path relies on the same), so `freeze` copies each module's entries
into its instance `__dict__`, where attribute lookup finds them first.

What stays correct: torch's own `setattr` of a parameter or submodule drops the instance entry, so
assigning one again after `freeze` is seen. What does not: writes that bypass it (`module._parameters[name]
= p`, `register_parameter` or `add_module` on an existing name), setting a parameter or submodule to
None, and `del module.name`. Code that restructures a loaded model that way calls `thaw` first.
"""

from __future__ import annotations

from torch import nn

_ALIASES = "_fw_aliases"  # the names `freeze` copied into a module's __dict__


def freeze(model: nn.Module) -> None:
    """Copy every module's submodules and parameters into its __dict__ (parameters win over a submodule of the
    same name, as in __getattr__; buffers and existing instance attributes are left alone). Idempotent."""
    for module in model.modules():
        state = module.__dict__
        if _ALIASES in state:
            continue
        entries = {**module._modules, **module._parameters}
        names = tuple(n for n in entries if n not in state and n not in module._buffers)
        for name in names:
            state[name] = entries[name]
        state[_ALIASES] = names


def thaw(model: nn.Module) -> None:
    """Undo `freeze`: lookups go through nn.Module.__getattr__ again."""
    for module in model.modules():
        for name in module.__dict__.pop(_ALIASES, ()):
            module.__dict__.pop(name, None)


def is_frozen(model: nn.Module) -> bool:
    return _ALIASES in model.__dict__
