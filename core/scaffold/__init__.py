"""`fw plugins new`: write a working, installable plugin package of one kind.

The package is real code, not a skeleton: it installs with pip, registers through the `fw` entry
point, and its tests (its own and fw's conformance suite, `fw.testing`) pass as generated. The
templates are files in `fw/scaffold/templates/`, rendered with string.Template."""

from __future__ import annotations

import importlib.metadata as md
from pathlib import Path
from typing import Iterable

from fw.errors import ConfigError
from fw.scaffold.kinds import KINDS, Kind
from fw.scaffold.names import PluginNames, check_name
from fw.scaffold.render import render, write_files
from fw.version import PLUGIN_API_VERSION, __version__

__all__ = ["KINDS", "PluginNames", "check_name", "new_plugin", "template_values"]


def template_values(kind: Kind, names: PluginNames) -> dict[str, str]:
    """Every placeholder the templates use."""
    package_files = sorted(Path(target.format(package=names.package)).name
                           for target in kind.all_files().values() if target.startswith("{package}/"))
    test_files = sorted(Path(target.format(package=names.package)).name
                        for target in kind.all_files().values() if target.startswith("tests/"))
    values = {
        "name": names.name,
        "distribution": names.distribution,
        "package": names.package,
        "entry_point": names.entry_point,
        "camel": names.camel,
        "kind": kind.cli_name,
        "registry_kind": kind.registry_kind,
        "kind_title": kind.title,
        "description": kind.description.format(name=names.name),
        "dependencies": ", ".join(f'"{d}"' for d in kind.dependencies),
        "fw_version": __version__,
        "api_version": PLUGIN_API_VERSION,
        "package_layout": _tree(package_files, "│   "),
        "test_layout": _tree(test_files, "    "),
        "hf_architecture": f"{names.camel}ForCausalLM",
        "model_type": f"fw_{names.entry_point}",
    }
    values["kind_readme"] = render(f"{kind.cli_name}/README.section.md.tmpl", values).rstrip("\n")
    return values


def _tree(files: list[str], indent: str) -> str:
    return "".join(f"{indent}{'└──' if i == len(files) - 1 else '├──'} {f}\n" for i, f in enumerate(files))


def new_plugin(kind: str, name: str, output_dir: str | Path = ".", *, taken: Iterable[str] = ()) -> Path:
    """Write the package for plugin `name` of `kind` under `output_dir`; return its directory.

    `taken`: names already registered for that kind (the caller's loaded plugins): a package that
    registered one of them again would fail to load with DuplicatePluginNameError, so refuse now."""
    if kind not in KINDS:
        raise ConfigError(f"unknown plugin kind {kind!r}; choose one of: {', '.join(KINDS)}")
    spec = KINDS[kind]
    names = PluginNames.from_name(name)
    if name in set(taken):
        article = "an" if spec.title[0] in "aeiou" else "a"
        raise ConfigError(f"{article} {spec.title} named {name!r} is already installed; choose another NAME "
                          f"(`fw plugins list --kind {spec.registry_kind}` shows the names in use)")
    owner = _entry_point_owner(names.entry_point)
    if owner is not None:
        raise ConfigError(f"the entry-point name {names.entry_point!r} is already used by the installed "
                          f"distribution {owner!r}; choose another NAME")
    output = Path(output_dir)
    if output.exists() and not output.is_dir():
        raise ConfigError(f"--output {str(output)!r} is a file, not a directory")
    root = output / names.distribution
    if root.exists():
        raise ConfigError(f"{str(root)!r} already exists; choose another NAME or --output directory, "
                          "or remove it first")
    values = template_values(spec, names)
    files = {target.format(package=names.package): render(template, values)
             for template, target in spec.all_files().items()}
    write_files(root, files)
    return root


def _entry_point_owner(entry_point: str) -> str | None:
    """The distribution that already declares `fw` entry point `entry_point`, if any."""
    for ep in md.entry_points(group="fw", name=entry_point):
        dist = getattr(ep, "dist", None)
        return dist.metadata["Name"] if dist is not None else "unknown"
    return None
