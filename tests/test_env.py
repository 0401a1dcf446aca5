"""fw.env: every FW_* switch that is not an engine option is declared there once, typed, and read only
through it; docs/flags.md lists them. The source checks read the code with ast (nothing is imported)."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from fw import env
from fw.config import EngineConfig, env_name
from fw.errors import ConfigError
from fw.server.config import ServerConfig

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("core", "architectures", "backends", "quantizers")
SKIP = ("core/commands/scaffold/templates", "core/commands/scaffold/examples")
FW_NAME = re.compile(r"^FW_[A-Z0-9_]+$")
NOT_A_SWITCH = {"FW_PLUGIN_API_VERSION"}  # a plugin module's attribute, not a variable
ALSO_AN_OPTION = {"FW_STRICT_PLUGINS"}  # the plugin manager reads it where no EngineConfig exists (fw plugins list)


def _sources():
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if not rel.startswith(SKIP):
                yield rel, ast.parse(path.read_text(encoding="utf-8"), rel)


def _fw_name(node: ast.AST, constants: dict[str, str]) -> str | None:
    """The FW_* variable an expression names: a string literal, or a module constant holding one."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and FW_NAME.match(node.value):
        return node.value
    if isinstance(node, ast.Name):
        return constants.get(node.id)
    return None


def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id in ("environ", "env", "environment")) or (
        isinstance(node, ast.Attribute) and node.attr == "environ")


def reads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, variable) of every read of an FW_* variable: environ.get(X) / [X] / X in environ, os.getenv(X)."""
    constants = {t.id: n.value.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
                 for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, ast.Constant)
                 and isinstance(n.value.value, str) and FW_NAME.match(n.value.value)}
    found = []
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            if isinstance(func, ast.Attribute) and (
                    (func.attr in ("get", "pop", "setdefault") and _is_environ(func.value)) or func.attr == "getenv"):
                name = _fw_name(node.args[0], constants)
        elif isinstance(node, ast.Subscript) and _is_environ(node.value):
            name = _fw_name(node.slice, constants)
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            name = _fw_name(node.left, constants)
        if name:
            found.append((node.lineno, name))
    return found


def test_only_fw_env_reads_fw_variables():
    found = [f"{rel}:{line}: {name}" for rel, tree in _sources() if rel != "core/env.py" for line, name in reads(tree)]
    assert not found, ("FW_* variables read outside fw.env: declare the switch there (typed, with its doc) and "
                       "read it through it:\n" + "\n".join(found))


def test_the_check_sees_every_way_of_reading():
    code = ('import os\nTRACE = "FW_X"\nos.environ.get("FW_A")\nos.getenv("FW_B", "1")\nos.environ["FW_C"]\n'
            '"FW_D" in os.environ\nenviron.get(TRACE)\nos.environ.get("HOME")\n')
    assert [name for _, name in reads(ast.parse(code))] == ["FW_A", "FW_B", "FW_C", "FW_D", "FW_X"]


def test_every_fw_name_in_the_code_is_declared_once():
    derived = {env_name(f.name) for cls in (EngineConfig, ServerConfig) for f in dataclasses.fields(cls)}
    declared = [s.name for s in env.SWITCHES]
    assert len(declared) == len(set(declared)) and set(declared) & derived == ALSO_AN_OPTION
    unknown = sorted({f"{rel}: {node.value}" for rel, tree in _sources() for node in ast.walk(tree)
                      if isinstance(node, ast.Constant) and isinstance(node.value, str) and FW_NAME.match(node.value)
                      and node.value not in {*declared, *derived, *NOT_A_SWITCH}})
    assert not unknown, f"FW_* names that neither fw.env nor the config declares: {unknown}"


def test_docs_list_every_switch():
    flags = (ROOT / "docs" / "flags.md").read_text(encoding="utf-8")
    section = flags.split("## Environment switches", 1)[1].split("\n## ", 1)[0]
    assert [s.name for s in env.SWITCHES] == re.findall(r"^\| `(FW_[A-Z0-9_]+)` \|", section, re.M)


def test_flags_read_their_words_and_refuse_others():
    on, off = env.CPU_FUSED_OPS, env.STRICT_PLUGINS
    assert on.get({}) is True and off.get({}) is False
    assert on.get({on.name: " "}) is True and off.get({off.name: ""}) is False  # blank: the default
    assert on.get({on.name: "OFF"}) is False and off.get({off.name: "Yes"}) is True
    with pytest.raises(ConfigError, match=r"FW_CPU_FUSED_OPS='maybe': expected one of 1, true, yes, on \(on\)"):
        on.get({on.name: "maybe"})


def test_choices_names_and_text():
    packing = env.CPU_WEIGHT_PACKING
    assert [packing.get({packing.name: v}) for v in ("0", "off", "1", "ONEDNN", "auto")] == \
        ["off", "off", "auto", "onednn", "auto"]
    assert packing.get({}) == "auto"
    with pytest.raises(ConfigError, match=r"FW_CPU_WEIGHT_PACKING='fast': expected one of auto, onednn, off"):
        packing.get({packing.name: "fast"})
    assert env.PLUGINS.get({"FW_PLUGINS": " fw, example ,, "}) == {"fw", "example"}
    assert env.PLUGINS.get({"FW_PLUGINS": " "}) is None and env.CONFIG.get({}) is None


def test_the_modules_read_the_switches(monkeypatch, tmp_path):
    from fw.kernels import cpu_ops, dense
    from fw.paths import cache_dir
    from fw.plugins.manager import PluginManager

    monkeypatch.setenv("FW_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FW_CPU_FUSED_OPS", "no")
    monkeypatch.setenv("FW_CPU_WEIGHT_PACKING", "sideways")
    monkeypatch.setenv("FW_DISABLE_PLUGINS", "a, b")
    assert cache_dir() == tmp_path and cpu_ops.wanted() is False
    assert PluginManager().block == {"a", "b"}
    with pytest.raises(ConfigError, match="FW_CPU_WEIGHT_PACKING='sideways'"):
        dense.cpu_packing_available()
