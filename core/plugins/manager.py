"""Finds plugins through entry points, loads each on its own, fills the registries.

A plugin that fails to import or register is recorded with its distribution
and error, and the others still load; strict mode turns any failure into an
error. Duplicate names are always an error unless the later registration says
``override=True``.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import importlib.util
import logging
import sys
import traceback
import warnings
import weakref
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable

import pluggy

from fw import env
from fw.errors import ConfigError, DuplicatePluginNameError, PluginLoadError
from fw.plugins import hookspecs, tracing
from fw.plugins.registry import Registry
from fw.plugins.specs import KINDS
from fw.version import PLUGIN_API_VERSION

logger = logging.getLogger("fw.plugins")

# kind -> the hook that registers it
HOOKS = {
    "architecture": "fw_register_architectures",
    "attention_backend": "fw_register_attention_backends",
    "moe_kernel": "fw_register_moe_kernels",
    "quantization_method": "fw_register_quantization_methods",
    "sampler": "fw_register_samplers",
    "grammar_backend": "fw_register_grammar_backends",
    "tool_parser": "fw_register_tool_parsers",
    "cli_command": "fw_register_cli_commands",
    "proposer": "fw_register_proposers",
    "executor": "fw_register_executors",
}
assert set(HOOKS) == set(KINDS)


@dataclass
class PluginInfo:
    """What `fw plugins list` shows for one plugin."""

    name: str
    distribution: str
    version: str
    module: str
    api_version: str | None = None
    error: str | None = None
    disabled: bool = False  # by FW_PLUGINS / FW_DISABLE_PLUGINS: listed, never imported
    warnings: list[str] = field(default_factory=list)
    provides: dict[str, list[str]] = field(default_factory=dict)
    overrides: dict[str, list[str]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "module": self.module,
            "api_version": self.api_version,
            "status": "error" if self.error else "disabled" if self.disabled else "loaded",
            "error": self.error,
            "warnings": self.warnings,
            "provides": self.provides,
            "overrides": self.overrides,
        }


def check_api_version(target: str | None) -> tuple[str | None, str | None]:
    """Return (refusal, warning) for a plugin that targets API version `target`."""
    if target is None:
        return None, None
    try:
        t_major, t_minor = (int(x) for x in str(target).split(".")[:2])
    except ValueError:
        return f"declares an unreadable FW_PLUGIN_API_VERSION {target!r} (expected 'MAJOR.MINOR')", None
    major, minor = (int(x) for x in PLUGIN_API_VERSION.split("."))
    if t_major != major:
        return (
            f"targets plugin API {target}, but this fw provides {PLUGIN_API_VERSION}; "
            f"install a version of the plugin built for API {major}.x",
            None,
        )
    if t_minor > minor:
        return None, f"targets plugin API {target}, newer than this fw's {PLUGIN_API_VERSION}; upgrade fw"
    return None, None


_DISTRIBUTIONS: "weakref.WeakKeyDictionary[md.Distribution, tuple[str, str]]" = weakref.WeakKeyDictionary()


def distribution_of(ep: md.EntryPoint) -> tuple[str, str]:
    """(name, version) of the distribution that declares `ep` ("unknown" for neither), read once per
    distribution: importlib.metadata parses its METADATA file again for every `.name` and `.version`, and
    one distribution declares all of fw's built-in plugins."""
    if ep.dist is None:
        return "unknown", "unknown"
    found = _DISTRIBUTIONS.get(ep.dist)
    if found is None:
        metadata = ep.dist.metadata
        found = _DISTRIBUTIONS[ep.dist] = (metadata["Name"], metadata["Version"])
    return found


class PluginManager:
    """Owns the pluggy manager, the plugin inventory and one registry per kind."""

    def __init__(
        self,
        strict: bool | None = None,
        allow: Iterable[str] | None = None,
        block: Iterable[str] | None = None,
        entry_points: Iterable[md.EntryPoint] | None = None,
        trace: bool | None = None,
    ):
        self.strict = env.STRICT_PLUGINS.get() if strict is None else strict
        # FW_TRACE_PLUGINS: specs are wrapped at registration, so tracing off costs nothing (fw.plugins.tracing)
        self.trace = tracing.enabled() if trace is None else trace
        if self.trace:
            tracing.enable_logging()
        self.allow = set(allow) if allow is not None else env.PLUGINS.get()
        self.block = set(block) if block is not None else (env.DISABLE_PLUGINS.get() or set())
        self._entry_points = entry_points
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: dict[str, PluginInfo] = {}
        self.registries: dict[str, Registry] = {kind: Registry(kind) for kind in KINDS}
        self.custom_architectures: list[str] = []  # spec names added by --custom-architectures
        self._loaded = False

    # -- loading -----------------------------------------------------------------

    def load(self) -> "PluginManager":
        if self._loaded:
            return self
        self._loaded = True
        eps = self._entry_points
        if eps is None:
            eps = md.entry_points(group=hookspecs.ENTRY_POINT_GROUP)
        for ep in sorted(eps, key=lambda e: (distribution_of(e)[0], e.name)):
            self._load_entry_point(ep)
        self._collect([n for n, p in self.plugins.items() if p.error is None and not p.disabled])
        self.raise_if_strict()
        return self

    def _enabled(self, name: str, dist: str) -> bool:
        if name in self.block or dist in self.block:
            return False
        return self.allow is None or name in self.allow or dist in self.allow

    def _load_entry_point(self, ep: md.EntryPoint) -> None:
        dist, version = distribution_of(ep)
        if not self._enabled(ep.name, dist):
            logger.info("plugin %s (%s) disabled by FW_PLUGINS/FW_DISABLE_PLUGINS", ep.name, dist)
            self.plugins.setdefault(ep.name, PluginInfo(ep.name, dist, version, ep.value, disabled=True))
            return
        if ep.name in self.plugins:
            other = self.plugins[ep.name]
            self.plugins[f"{ep.name}@{dist}"] = PluginInfo(
                ep.name, dist, version, ep.value,
                error=f"plugin name {ep.name!r} is also used by {other.distribution}; rename one entry point",
            )
            return
        info = PluginInfo(ep.name, dist, version, ep.value)
        self.plugins[ep.name] = info
        try:
            obj = tracing.traced_load(ep, ep.name) if self.trace else ep.load()
        except Exception as exc:  # a broken plugin must not take the others down
            info.error = f"{type(exc).__name__}: {exc}"
            logger.warning("plugin %s from %s failed to import: %s", ep.name, dist, info.error)
            logger.debug("%s", traceback.format_exc())
            return
        self._register_object(info, obj)

    def _register_object(self, info: PluginInfo, obj: Any) -> None:
        info.api_version = getattr(obj, "FW_PLUGIN_API_VERSION", None)
        refusal, warning = check_api_version(info.api_version)
        if refusal:
            info.error = f"refused: {refusal}"
            return
        if warning:
            info.warnings.append(warning)
            warnings.warn(f"fw plugin {info.name} ({info.distribution}) {warning}", stacklevel=2)
        try:
            self.pm.register(obj, name=info.name)
        except Exception as exc:
            info.error = f"{type(exc).__name__}: {exc}"

    def _collect(self, plugin_names: list[str]) -> None:
        """Call each plugin's registration hooks, attributing what it registers."""
        for kind, hook_name in HOOKS.items():
            hook = getattr(self.pm.hook, hook_name)
            impls = {self.pm.get_name(impl.plugin): impl for impl in hook.get_hookimpls()}
            for name in plugin_names:
                impl = impls.get(name)
                info = self.plugins[name]
                if impl is None or info.error:
                    continue
                register = partial(self._register_spec, kind, info)
                call = impl.function
                if self.trace:
                    call = tracing.traced_hook(name, hook_name, call, partial(info.provides.get, kind, []))
                try:
                    call(register=register)
                except DuplicatePluginNameError:
                    raise
                except Exception as exc:
                    info.error = f"{hook_name} raised {type(exc).__name__}: {exc}"
                    logger.warning("plugin %s from %s failed: %s", name, info.distribution, info.error)
                    # All or nothing: a half-registered plugin must not serve requests.
                    for registry in self.registries.values():
                        registry.remove_plugin(name)
                    info.provides.clear()
                    info.overrides.clear()

    def _register_spec(self, kind: str, info: PluginInfo, spec: Any, override: bool = False) -> None:
        spec_kind = getattr(spec, "kind", None)
        if spec_kind != kind:
            raise TypeError(f"{info.name} passed a {type(spec).__name__} (kind {spec_kind}) to the {kind} registry")
        if self.trace:
            spec = tracing.traced_spec(spec, info.name)
        registration = self.registries[kind].add(spec, info.name, info.distribution, override=override)
        info.provides.setdefault(kind, []).append(spec.name)
        if registration.overrides:
            # Credit the winner, which is not `info` when an earlier plugin overrode this one.
            winner = self.plugins.get(registration.plugin, info)
            winner.overrides.setdefault(kind, []).append(f"{spec.name} (from {registration.overrides[-1]})")

    def raise_if_strict(self) -> None:
        if self.strict:
            raise_for_failures(self.inventory())

    # -- custom architectures (--custom-architectures) ------------------------------

    def add_custom_architectures(self, refs: Iterable[str]) -> None:
        """Import each `PATH:MODULE`, `file.py` or `dotted.module` and register its ARCHITECTURES.

        Entries override built-ins of the same name; the override is shown, not silent."""
        for ref in refs:
            module = import_custom_module(ref)
            specs = getattr(module, "ARCHITECTURES", None)
            if not isinstance(specs, (list, tuple)) or not specs:
                raise ConfigError(
                    f"--custom-architectures {ref}: module {module.__name__} must define a non-empty "
                    f"ARCHITECTURES list of fw.plugins.ArchitectureSpec"
                )
            info = PluginInfo(
                f"custom:{module.__name__}", f"custom ({getattr(module, '__file__', ref)})", "-", module.__name__
            )
            info.api_version = getattr(module, "FW_PLUGIN_API_VERSION", None)
            refusal, _ = check_api_version(info.api_version)
            if refusal:
                raise ConfigError(f"--custom-architectures {ref}: {refusal}")
            self.plugins[info.name] = info
            for spec in specs:
                self._register_spec("architecture", info, spec, override=True)
                self.custom_architectures.append(spec.name)

    # -- queries ----------------------------------------------------------------------

    def registry(self, kind: str) -> Registry:
        return self.registries[kind]

    def failures(self) -> list[PluginInfo]:
        return [p for p in self.plugins.values() if p.error]

    def inventory(self, kind: str | None = None) -> list[dict]:
        return rows_of_kind([info.to_dict() for info in self.plugins.values()], kind)

    def hook_implementations(self, hook: str) -> list[tuple[str, Callable[..., object]]]:
        """(plugin name, function) of each registered implementation of a hook the core calls one plugin at a
        time, so that one plugin's failure is reported and the others still run (pluggy's own call would stop
        at the first exception)."""
        return [(self.pm.get_name(impl.plugin), impl.function) for impl in getattr(self.pm.hook, hook).get_hookimpls()]


def rows_of_kind(rows: list[dict], kind: str | None) -> list[dict]:
    """Inventory rows of the plugins providing `kind` (and of those that failed), each showing only that
    kind; all rows when `kind` is None."""
    if kind is None:
        return rows
    return [{**row, "provides": {kind: row["provides"].get(kind, [])}} for row in rows
            if kind in row["provides"] or row["error"] is not None]


def raise_for_failures(rows: list[dict]) -> None:
    """Strict mode's error, naming every plugin that failed, if any row shows a failure."""
    failed = [row for row in rows if row["error"]]
    if failed:
        lines = "; ".join(f"{r['name']} ({r['distribution']}): {r['error']}" for r in failed)
        raise PluginLoadError(f"--strict-plugins: {len(failed)} plugin(s) failed to load: {lines}")


def import_custom_module(ref: str):
    """Import a module given as `DIR:MODULE`, a path to a `.py` file, or a dotted name."""
    try:
        if ":" in ref and Path(ref.rsplit(":", 1)[0]).is_dir():
            directory, module_name = ref.rsplit(":", 1)
            directory = str(Path(directory).resolve())
            if directory not in sys.path:
                sys.path.insert(0, directory)
            return importlib.import_module(module_name)
        if ref.endswith(".py"):
            path = Path(ref).resolve()
            if not path.is_file():
                raise ConfigError(f"--custom-architectures {ref}: no such file")
            name = f"fw_custom_{path.stem}"  # never shadows an installed module of the file's name
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
            return module
        return importlib.import_module(ref)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(
            f"--custom-architectures {ref}: could not import it ({type(exc).__name__}: {exc}). "
            f"Give DIR:MODULE, a .py file, or an importable dotted module name."
        ) from exc


_default: PluginManager | None = None


def engine_plugins(config, plugins: PluginManager | None = None) -> PluginManager:
    """The plugins an engine (or a command acting for one) uses: `plugins` if given, else the process's
    manager, or a manager of its own when `config.custom_architectures` names modules (so they do not leak
    into later engines of the same process); `config.strict_plugins` makes failed plugins an error."""
    if plugins is None:
        plugins = PluginManager().load() if config.custom_architectures else get_plugin_manager()
    if config.strict_plugins:
        plugins.strict = True
        plugins.raise_if_strict()
    if config.custom_architectures:
        plugins.add_custom_architectures(config.custom_architectures)
    return plugins


def get_plugin_manager(strict: bool | None = None) -> PluginManager:
    """The process-wide manager, loaded on first use.

    `strict` (from a CLI flag) takes precedence over FW_STRICT_PLUGINS when the
    manager is created, and makes an already loaded one fail if plugins failed."""
    global _default
    if _default is None:
        _default = PluginManager(strict=strict).load()
    elif strict:
        _default.strict = True
        _default.raise_if_strict()
    return _default


def reset_plugin_manager() -> None:
    """Forget the process-wide manager (tests, or after installing a plugin at runtime)."""
    global _default
    _default = None
