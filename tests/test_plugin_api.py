"""The stable plugin API (docs/plugin-api.md): the committed snapshot matches the code, the
comparison notices changes and says which version bump they need, and deprecations announced
through pluggy's hookspec options reach plugin authors."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path
from typing import Any, Callable

import pluggy
import pytest
import torch

from fw.commands import api_snapshot
from fw.plugins import hookspecs, specs
from fw.commands.api_snapshot import REGENERATE, bump_problem, check, compute_entries, diff, needed_bump
from fw.plugins.deprecation import PluginApiDeprecationWarning, plugin_api_deprecation, warn_deprecated
from fw.version import PLUGIN_API_VERSION

REPO = Path(__file__).resolve().parent.parent
SNAPSHOT = REPO / "docs" / "plugin-api-snapshot.json"


@pytest.fixture(scope="module")
def entries() -> dict[str, str]:
    return compute_entries()


def _snap(version: str, entries: dict[str, str]) -> dict[str, Any]:
    return {"api_version": version, "regenerate": REGENERATE, "entries": entries}


def _hookspecs_with(name: str, func: Callable | None) -> types.ModuleType:
    """A copy of fw.plugins.hookspecs with hook `name` replaced by `func` (None: removed)."""
    fake = types.ModuleType("fake_hookspecs")
    fake.__dict__.update({k: v for k, v in vars(hookspecs).items() if k != name})
    if func is not None:
        fake.__dict__[name] = hookspecs.hookspec(func)
    return fake


# -- the committed snapshot ----------------------------------------------------------------------


def test_committed_snapshot_matches_the_code():
    committed = api_snapshot.load(SNAPSHOT)
    problems = check(committed, api_snapshot.snapshot())
    assert not problems, "\n".join(problems)


def test_snapshot_is_keyed_by_the_plugin_api_version():
    committed = json.loads(SNAPSHOT.read_text())
    assert committed["api_version"] == PLUGIN_API_VERSION
    assert committed["regenerate"] == REGENERATE


def test_snapshot_covers_every_hook_spec_and_stable_type(entries):
    hooks = [n for n, f in vars(hookspecs).items() if hasattr(f, "fw_spec")]
    assert len(hooks) >= 11
    for hook in hooks:
        assert f"hook {hook}" in entries
    for dotted, role in api_snapshot.STABLE_TYPES:
        assert f"{role} {dotted}" in entries
    # fields and signatures, not just names
    assert entries["use fw.plugins.specs.SamplerSpec(order)"] == "#3 pos/kw: int = 100"
    assert entries["impl fw.layers.attention.AttentionBackend.forward(kv_cache)"].startswith("#3 pos/kw")
    assert entries["hook fw_add_cli_arguments(parser)"] == "#1 pos/kw, required"
    assert entries["use fw.errors.ConfigError"] == "class(FwError)"


# -- the test of the test: mutations in memory are reported --------------------------------------


def test_a_new_hook_argument_is_breaking_and_names_the_fix(entries):
    def fw_add_cli_arguments(command: str, parser, plugins) -> None:
        """One argument more: every existing implementation is called with it and breaks."""

    mutated = compute_entries(_hookspecs_with("fw_add_cli_arguments", fw_add_cli_arguments))
    changes = diff(entries, mutated)
    assert [str(c) for c in changes] == [
        "BREAKING: added hook fw_add_cli_arguments(plugins) (#2 pos/kw, required)"]
    problem = bump_problem(_snap("1.0", entries), _snap("1.0", mutated))
    assert "PLUGIN_API_VERSION is still 1.0" in problem
    assert "hook fw_add_cli_arguments(plugins)" in problem
    assert 'major bump: set PLUGIN_API_VERSION = "2.0" in core/version.py' in problem
    assert REGENERATE in problem


def test_removed_and_renamed_hook_arguments_are_reported(entries):
    def fw_add_server_routes(app, server_state) -> None:
        """`state` renamed."""

    changes = diff(entries, compute_entries(_hookspecs_with("fw_add_server_routes", fw_add_server_routes)))
    assert {(c.what, c.key, c.breaking) for c in changes} == {
        ("removed", "hook fw_add_server_routes(state)", True),
        ("added", "hook fw_add_server_routes(server_state)", True)}
    removed = diff(entries, compute_entries(_hookspecs_with("fw_register_moe_kernels", None)))
    assert all(c.breaking and c.what == "removed" for c in removed)
    assert "hook fw_register_moe_kernels" in {c.key for c in removed}


def test_a_new_hook_is_additive(entries):
    def fw_register_widgets(register) -> None:
        """A new kind."""

    changes = diff(entries, compute_entries(_hookspecs_with("fw_register_widgets", fw_register_widgets)))
    assert changes and not any(c.breaking for c in changes)
    assert needed_bump(changes) == "minor"
    problem = bump_problem(_snap("1.0", entries), _snap("1.0", compute_entries(
        _hookspecs_with("fw_register_widgets", fw_register_widgets))))
    assert 'minor bump: set PLUGIN_API_VERSION = "1.1"' in problem


def _spec_with_extra_field(base: type, name: str, field_type: type, default: Any) -> type:
    """`base` with one more field at the end, as a frozen dataclass of the same name and module."""
    fields = [(f.name, f.type, f) for f in dataclasses.fields(base)]
    extra = dataclasses.field() if default is dataclasses.MISSING else dataclasses.field(default=default)
    if default is dataclasses.MISSING:  # a required field must come before the defaulted ones
        fields.insert(0, (name, field_type, extra))
    else:
        fields.append((name, field_type, extra))
    namespace = {k: v for k, v in vars(base).items() if k in ("kind", "rejection_reasons", "summary")}
    cls = dataclasses.make_dataclass(base.__name__, fields, namespace=namespace, frozen=True)
    cls.__module__ = base.__module__
    return cls


def test_a_spec_field_with_a_default_is_additive(monkeypatch, entries):
    monkeypatch.setattr(specs, "MoeKernelSpec", _spec_with_extra_field(specs.MoeKernelSpec, "tile", int, 64))
    changes = diff(entries, compute_entries())
    assert [str(c) for c in changes] == [
        "additive: added use fw.plugins.specs.MoeKernelSpec(tile) (#10 pos/kw: int = 64)"]
    # after the minor bump and a regenerate, all is well; the regenerate is what remains to do
    bumped = _snap("1.1", compute_entries())
    assert bump_problem(_snap("1.0", entries), bumped) is None
    assert "regenerate it with `python -m fw.commands.api_snapshot --write`" in check(_snap("1.0", entries), bumped)[0]


def test_a_required_spec_field_is_breaking_and_a_minor_bump_is_refused(monkeypatch, entries):
    monkeypatch.setattr(specs, "MoeKernelSpec",
                        _spec_with_extra_field(specs.MoeKernelSpec, "tile", int, dataclasses.MISSING))
    mutated = compute_entries()
    changes = diff(entries, mutated)
    assert needed_bump(changes) == "major"
    # it went in first: every other field moved one place along, which breaks positional construction too
    assert any(c.what == "changed" and c.key == "use fw.plugins.specs.MoeKernelSpec(name)" for c in changes)
    problem = bump_problem(_snap("1.0", entries), _snap("1.1", mutated))
    assert "1.0 -> 1.1 is a minor bump, but these changes break plugins" in problem
    assert "Bump to 2.0" in problem
    assert bump_problem(_snap("1.0", entries), _snap("2.0", mutated)) is None


def test_a_changed_method_of_an_implemented_interface_is_breaking(monkeypatch, entries):
    from fw.layers.linear import LinearMethod

    def apply(self, layer, x, bias_override=None):  # even an optional argument: the core would pass it
        raise NotImplementedError

    monkeypatch.setattr(LinearMethod, "apply", apply)
    changes = {c.key: c for c in diff(entries, compute_entries())}
    added = changes["impl fw.layers.linear.LinearMethod.apply(bias_override)"]
    assert added.what == "added" and added.breaking
    assert changes["impl fw.layers.linear.LinearMethod.apply(layer)"].what == "changed"  # lost its annotation


def test_an_optional_parameter_of_a_called_function_is_additive(monkeypatch, entries):
    from fw.layers import moe

    def topk_routing(logits: torch.Tensor, top_k: int, renormalize: bool, weights_in_model_dtype: bool, *,
                     bias=None) -> tuple[torch.Tensor, torch.Tensor]:  # annotations stay text: never evaluated
        raise NotImplementedError

    monkeypatch.setattr(moe, "topk_routing", topk_routing)
    changes = diff(entries, compute_entries())
    assert {c.key: c.breaking for c in changes if c.what == "added"} == {"use fw.layers.moe.topk_routing(bias)": False}


def test_a_removed_export_and_a_removed_kind_are_breaking(monkeypatch, entries):
    import fw.plugins

    monkeypatch.setattr(fw.plugins, "__all__", [n for n in fw.plugins.__all__ if n != "ToolParserSpec"])
    monkeypatch.setattr(specs, "KINDS", tuple(k for k in specs.KINDS if k != "tool_parser"))
    changes = diff(entries, compute_entries())
    assert {(c.key, c.what, c.breaking) for c in changes} == {
        ("export fw.plugins.ToolParserSpec", "removed", True),
        ("const fw.plugins.specs.KINDS['tool_parser']", "removed", True)}


def test_an_untyped_parameter_given_its_stated_type_is_additive():
    """`Any` (or no annotation) filled in with the type the docstring promised changes nothing plugins
    pass or receive at run time; any other retyping, or one of a hook or an implemented interface,
    still breaks."""
    spec = "use fw.plugins.specs.ArchitectureSpec(build)"
    cases = {
        (spec, "#2 pos/kw: Callable[..., Any], required", "#2 pos/kw: ArchitectureBuild, required"): False,
        (spec, "#2 pos/kw, required", "#2 pos/kw: ArchitectureBuild, required"): False,
        (spec, "#5 pos/kw: Callable[[str, Any, Any], Any] | None = None",
         "#5 pos/kw: Callable[[str, torch.Tensor, X], torch.Tensor] | None = None"): False,
        (spec, "#1 pos/kw: Callable[[dict], bool] | None = None",
         "#1 pos/kw: Callable[[dict[str, int]], bool] | None = None"): True,  # dict narrowed: not an Any
        (spec, "#1 pos/kw: int = 1", "#1 pos/kw: str = 1"): True,
        (spec, "#2 pos/kw: Callable[..., Any], required", "#2 pos/kw: ArchitectureBuild = None"): True,
        (spec, "#2 pos/kw: Callable[..., Any], required", "#3 pos/kw: ArchitectureBuild, required"): True,
        ("hook fw_register_widgets(register)", "#0 pos/kw", "#0 pos/kw: Callable[[Any], None]"): True,
        ("impl fw.layers.moe.MoeKernel.apply(x)", "#0 pos/kw", "#0 pos/kw: torch.Tensor"): True,
    }
    for (key, old, new), breaking in cases.items():
        (change,) = diff({key: old}, {key: new})
        assert change.breaking is breaking, (key, old, new)
    (typed,) = diff({spec: "#2 pos/kw: Callable[..., Any], required"},
                    {spec: "#2 pos/kw: ArchitectureBuild, required"})
    assert str(typed).startswith("additive: typed ") and needed_bump([typed]) == "minor"


def test_versions_only_grow(entries):
    assert "went backwards" in bump_problem(_snap("1.2", entries), _snap("1.1", entries))


def test_write_refuses_an_unbumped_change_and_check_reports_it(tmp_path, monkeypatch, capsys):
    path = tmp_path / "snapshot.json"
    assert api_snapshot.main(["--write", "--path", str(path)]) == 0
    assert api_snapshot.main(["--check", "--path", str(path)]) == 0
    written = path.read_text()
    monkeypatch.setattr(specs, "MoeKernelSpec", _spec_with_extra_field(specs.MoeKernelSpec, "tile", int, 64))
    capsys.readouterr()
    assert api_snapshot.main(["--check", "--path", str(path)]) == 1
    assert "MoeKernelSpec(tile)" in capsys.readouterr().err
    assert api_snapshot.main(["--write", "--path", str(path)]) == 1
    assert "not written: The stable plugin API changed" in capsys.readouterr().err
    assert path.read_text() == written
    major, minor = PLUGIN_API_VERSION.split(".")
    monkeypatch.setattr("fw.version.PLUGIN_API_VERSION", f"{major}.{int(minor) + 1}")
    assert api_snapshot.main(["--write", "--path", str(path)]) == 0
    assert json.loads(path.read_text())["api_version"] == f"{major}.{int(minor) + 1}"


# -- deprecations through pluggy's hookspec options ----------------------------------------------


_DEPRECATION_SCRIPT = """
import importlib.metadata as md, sys
import pluggy
from fw.plugins.deprecation import plugin_api_deprecation
from fw.plugins.hookspecs import hookspec
from fw.plugins.manager import PluginManager


class TemporarySpecs:
    @hookspec(warn_on_impl_args={"state": plugin_api_deprecation(
        "fw_demo_routes(state)", since="1.0", removed_in="2.0", instead="app.state")})
    def fw_demo_routes(self, app, state):
        '''A hook whose `state` argument is on its way out.'''

    @hookspec(warn_on_impl=plugin_api_deprecation(
        "fw_demo_old_hook", since="1.0", removed_in="2.0", instead="fw_demo_routes"))
    def fw_demo_old_hook(self, register):
        '''A hook on its way out.'''


eps = [md.EntryPoint(name=n, value=n, group="fw") for n in sys.argv[1:]]
manager = PluginManager(entry_points=eps)
manager.pm.add_hookspecs(TemporarySpecs)
manager.load()
print("loaded:", ", ".join(n for n, p in manager.plugins.items() if p.error is None))
"""

_PLUGINS = {
    "uses_state": """
        from fw.plugins import hookimpl

        @hookimpl
        def fw_demo_routes(app, state):
            pass
        """,
    "app_only": """
        from fw.plugins import hookimpl

        @hookimpl
        def fw_demo_routes(app):
            pass
        """,
    "old_hook": """
        from fw.plugins import hookimpl

        @hookimpl
        def fw_demo_old_hook(register):
            pass
        """,
}


def test_deprecations_warn_plugin_authors_under_default_warning_filters(tmp_path):
    """A plugin module is never __main__, where Python shows DeprecationWarnings by default: the
    warning is a FutureWarning, shown with the plugin's file and line, and the plugin still loads."""
    for name, source in _PLUGINS.items():
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    (tmp_path / "demo.py").write_text(_DEPRECATION_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    env["PYTHONPATH"] = str(tmp_path)
    proc = subprocess.run([sys.executable, str(tmp_path / "demo.py"), *_PLUGINS], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "loaded: app_only, old_hook, uses_state" in proc.stdout  # sorted by name
    lines = [line for line in proc.stderr.splitlines() if "PluginApiDeprecationWarning" in line]
    assert len(lines) == 2, proc.stderr
    assert any("uses_state.py" in line and "fw_demo_routes(state) is deprecated since fw plugin API 1.0 and will "
               "be removed in 2.0; use app.state instead" in line for line in lines), proc.stderr
    assert any("old_hook.py" in line and "fw_demo_old_hook is deprecated" in line for line in lines), proc.stderr
    assert "app_only.py" not in proc.stderr  # an implementation that does not take `state` is not warned


def test_deprecation_warning_is_not_hidden_by_default():
    assert issubclass(PluginApiDeprecationWarning, FutureWarning)
    assert not issubclass(PluginApiDeprecationWarning, DeprecationWarning)


def test_warn_deprecated_points_at_the_caller_of_the_deprecated_spelling():
    def read_old_field():
        warn_deprecated("AttentionBackendSpec.old_field", since="1.1", removed_in="2.0", instead="new_field",
                        stacklevel=3)

    with pytest.warns(PluginApiDeprecationWarning, match="removed in 2.0; use new_field instead") as record:
        read_old_field()  # this line is the plugin's
    assert record[0].filename == __file__


def test_deprecation_markers_work_with_pluggy_directly():
    """The same options on the real marker type fw's hookspecs use (no fw manager involved)."""
    marker = pluggy.HookspecMarker("fw")
    impl_marker = pluggy.HookimplMarker("fw")

    class Spec:
        @marker(warn_on_impl_args={"parser": plugin_api_deprecation("x(parser)", since="1.0", removed_in="2.0",
                                                                    instead="y")})
        def x(self, command, parser):
            pass

    class Plugin:
        @impl_marker
        def x(self, command, parser):
            pass

    pm = pluggy.PluginManager("fw")
    pm.add_hookspecs(Spec)
    with pytest.warns(PluginApiDeprecationWarning, match=r"x\(parser\) is deprecated since fw plugin API 1.0"):
        pm.register(Plugin())


@pytest.mark.parametrize("old, new, names", [
    ("fw.cpp_ops", "fw.kernels.loader", ("load_cpp_ops", "unavailable")),
    ("fw.model_config", "fw.model.config", ("ModelConfig", "RopeConfig", "MoeConfig")),
])
def test_a_moved_module_keeps_its_old_name_with_a_warning(monkeypatch, old, new, names):
    """Modules of the plugin API moved in 1.10 (issue 20's folders): the old module re-exports the new one's
    names, warning, until 2.0."""
    from fw.plugins.deprecation import PluginApiDeprecationWarning

    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(PluginApiDeprecationWarning, match=rf"{old} is deprecated since fw plugin API 1\.10 .*"
                                                          rf"use {new} instead"):
        module = importlib.import_module(old)
    assert all(getattr(module, name) is getattr(importlib.import_module(new), name) for name in names)
