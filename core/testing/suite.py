"""Builds the pytest class a plugin author gets from `conformance_suite(kind, name)`.

Each plugin kind has a suite module (fw.testing.attention, ...) with one function,
``tests(spec, options) -> list[SuiteTest]``: the test methods and the cases each is
parametrised over. Cases are computed from the spec when the class is built (at collection),
so test ids name them; a case the plugin cannot run here carries its skip reason. A name that
is not installed gives a class whose one test fails, listing what is installed: a typo in the
one line must not pass as "all skipped"."""

from __future__ import annotations

import importlib
import re
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

# kind -> the module with its suite (imported only when a suite of that kind is built)
SUITE_KINDS = {
    "attention_backend": "fw.testing.attention",
    "moe_kernel": "fw.testing.moe",
    "quantization_method": "fw.testing.quantization",
    "sampler": "fw.testing.samplers",
    "grammar_backend": "fw.testing.grammar",
    "architecture": "fw.testing.architecture",
    "executor": "fw.testing.executor",
}

# options every suite takes
COMMON_OPTIONS = frozenset({"device"})


@dataclass(frozen=True)
class Case:
    """One parametrised case: `id` names it in the test id and in failure messages; `skip` is why
    the plugin cannot run it here (None: it runs); `data` is what the suite needs to run it."""

    id: str
    data: dict[str, Any] = field(default_factory=dict, compare=False)
    skip: str | None = None


@dataclass
class SuiteTest:
    """One test method: `run(case)` raises AssertionError (naming the case) when the plugin fails it."""

    name: str
    run: Callable[[Case], None]
    cases: list[Case]
    doc: str = ""


def conformance_suite(kind: str, name: Any, **options: Any) -> type:
    """A pytest test class checking the plugin `name` of `kind` (or a spec object) against its suite.

    Assign it to a module-level name starting with ``Test``; pytest collects it like any class.
    `options` tune a suite (see docs/plugin-testing.md); an unknown one is a TypeError here."""
    if kind not in SUITE_KINDS:
        raise ValueError(f"conformance_suite: unknown plugin kind {kind!r}; kinds with a suite: "
                         f"{', '.join(SUITE_KINDS)}")
    suite = importlib.import_module(SUITE_KINDS[kind])
    allowed = COMMON_OPTIONS | suite.OPTIONS
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise TypeError(f"conformance_suite({kind!r}): unknown option(s) {', '.join(unknown)}; "
                        f"{kind} suites take: {', '.join(sorted(allowed))}")
    if isinstance(name, str):
        spec, missing = _installed_spec(kind, name)
        label = name
        if spec is None:
            return _failing_class(kind, label, missing)
    else:
        spec, label = name, getattr(name, "name", None)
        if getattr(spec, "kind", None) != kind or not isinstance(label, str):
            raise TypeError(f"conformance_suite({kind!r}, ...): expected an installed {kind} name or a "
                            f"{kind} spec object (fw.plugins), got {type(name).__name__}")
    methods: dict[str, Any] = {"__doc__": f"fw conformance suite: {kind} {label!r}", "spec": spec,
                               "kind": kind}
    for test in suite.tests(spec, dict(options)):
        methods[test.name] = _parametrised(test)
    return type(_class_name(kind, label), (), methods)


def _parametrised(test: SuiteTest):
    import pytest  # here: `import fw.testing` stays cheap outside pytest (the package docstring)

    run = test.run

    def method(self, case: Case) -> None:
        if case.skip:
            pytest.skip(f"{case.id}: {case.skip}")
        run(case)

    method.__name__ = test.name
    method.__doc__ = test.doc
    params = [pytest.param(c, id=c.id) for c in test.cases]
    return pytest.mark.parametrize("case", params)(method)


def _installed_spec(kind: str, name: str) -> tuple[Any, str | None]:
    """(spec, None) for an installed plugin, or (None, why not: the installed names of that kind)."""
    from fw.plugins.manager import get_plugin_manager  # here: as in _parametrised; the plugins load with a suite

    manager = get_plugin_manager()
    registry = manager.registry(kind)
    if name in registry:
        return registry.get(name), None
    failed = [f"{p.name} ({p.distribution}): {p.error}" for p in manager.failures()]
    message = (f"no {kind} named {name!r} is installed; installed {kind} names: "
               f"{', '.join(registry.names()) or '(none)'}. Install the plugin (pip install -e .) so its "
               f"entry point is registered, or pass its spec object instead of the name.")
    if failed:
        message += " Plugins that failed to load: " + "; ".join(failed)
    return None, message


def _failing_class(kind: str, label: str, message: str) -> type:
    def test_plugin_is_installed(self) -> None:
        import pytest  # here: as in _parametrised

        pytest.fail(message, pytrace=False)

    return type(_class_name(kind, label), (), {"test_plugin_is_installed": test_plugin_is_installed})


def _class_name(kind: str, label: str) -> str:
    kind_part = "".join(word.title() for word in kind.split("_"))
    return f"Test{kind_part}Conformance_{re.sub(r'[^0-9A-Za-z_]', '_', label)}"


def worst_difference(got, want, atol: float, rtol: float):
    """(max |got - want|, its flat index, whether every element is within atol + rtol * |want|)."""
    diff = (got.double() - want.double()).abs()
    bound = atol + rtol * want.double().abs()
    nonfinite = ~torch_isfinite(got)
    index = int((diff - bound).nan_to_num(float("inf")).argmax())
    ok = bool(((diff <= bound) & ~nonfinite).all())
    return float(diff.reshape(-1)[index]), index, ok


def torch_isfinite(x):
    import torch  # here: as in _parametrised (torch costs 1 s)

    return torch.isfinite(x)


def device_for(spec: Any, options: dict) -> str:
    """The device the suite runs on: the `device` option, else cuda when available and declared, else cpu."""
    if options.get("device"):
        return str(options["device"])
    import torch  # here: as in torch_isfinite

    devices = getattr(spec, "devices", ("cpu",))
    return "cuda" if torch.cuda.is_available() and "cuda" in devices else "cpu"


def availability(spec: Any) -> str | None:
    """What the spec's `available()` says against running here, or None."""
    check = getattr(spec, "available", None)
    return check() if check is not None else None


def stable_seed(text: str) -> int:
    return zlib.crc32(text.encode())
