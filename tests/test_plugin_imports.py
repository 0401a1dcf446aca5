"""The built-in plugins (architectures/, backends/, quantizers/) and the plugin distributions in plugins/
import nothing of fw but the documented plugin API (docs/plugin-api.md, "What is stable", and the model
building blocks of fw.layers), their own package's modules, and the exceptions listed below with why.
Read from the source with ast (every import, inside functions too): a plugin that reaches into fw's
internals breaks when they move, which the plugin API promises not to do to third parties."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import import_graph  # noqa: E402  (scripts/import_graph.py: how an import statement names modules)

# The plugin API, module by module: "*" for every public name, else the package's `__all__` (read from its
# source) plus the submodules named here. fw.testing is the plugin authors' test kit.
API_PACKAGES = ("fw.plugins", "fw.layers", "fw.grammar", "fw.speculative", "fw.warm")  # __all__ + below
API_MODULES = (
    "fw.plugins.specs", "fw.plugins.hookspecs", "fw.plugins.deprecation",  # the specs and hooks
    "fw.layers.attention", "fw.layers.linear", "fw.layers.moe",  # the contracts plugins implement
    "fw.sampling.batch", "fw.sampling.params",  # what samplers read
    "fw.grammar.contract", "fw.grammar.constraint",  # the grammar-backend contract
    "fw.tool_parsing",  # the tool-parser contract and the helpers parsers share
    "fw.speculative.contract",  # the proposer contract
    "fw.warm.artifact", "fw.warm.resolve",  # the warm-cache contract; what the server would pick (loading.md)
    "fw.kernels.loader",  # load_cpp_ops / unavailable: how a plugin builds and loads its C++ kernels (loading.md)
    "fw.errors", "fw.model.config", "fw.testing",
)
# Reaching past the API on purpose: (the importing plugin module or package, the fw module) -> why.
EXCEPTIONS = {
    ("fw.quantizers", "fw.kernels.packed_int"):
        "the packed 4/8-bit CPU kernels (fw.kernels) every built-in quantization method packs its weights for "
        "(docs/quantization.md); their layout changes with the kernels, so it is not promised to third parties",
    ("fw.quantizers.gguf", "fw.kernels.dense"):
        "a layer without a packed-int kernel is dequantized at load into fw's dense layout, and the method keeps "
        "the layout pack_dense chose (DenseLayout) to run it and fuse the SiLU: the unquantized method's own "
        "kernel, internal like the packed-int ones",
    ("fw.quantizers.gguf", "fw.kernels.packed_record"):
        "GGUF weights repacked for those kernels, recorded in fw's cache by the blocks' hash: the gguf method's "
        "side of the loader's record, internal for the same reason",
    ("fw.backends.attention.cpu_paged", "fw.kernels"):
        "its C++ source lives with fw's other kernels (fw.kernels.source, built and installed with them); a "
        "third-party backend ships its source beside its own module",
    ("fw.backends.attention.flex", "fw.compile.isolated"):
        "FlexAttention is only fast compiled; compile_isolated gives each key its own recompile budget, the "
        "helper fw.compile's step uses too (it moves with the kernels)",
    ("fw.quantizers.bitsandbytes", "fw.env"):
        "its FW_BNB_INT8_MATMUL switch is declared with fw's other FW_* switches in fw.env (one typed list, one "
        "table in docs/flags.md); a third-party plugin reads its own variables",
    ("fw.backends.executors.external_launcher", "fw.distributed.launch"):
        "torchrun's env:// layout and store are fw's rendezvous (the same prefix, join deadline and errors as "
        "fw's own start-up): the core's launcher support in executor form; a third-party executor starts "
        "processes and lets rank 0 serve the meeting point",
    ("fw.backends.executors.external_launcher", "fw.config"):
        "under a launcher the layout (--tensor-parallel-size, --nnodes, --node-rank) comes from its variables, "
        "so prepare() returns a changed EngineConfig",
    ("fw.backends.speculative.draft_model", "fw.speculative.draft_runner"):
        "the draft_model proposer runs a second fw model beside the target with the engine's own runner, KV "
        "pages and loader: the core's proposer in plugin form, not something a third-party proposer implements",
}
BUILTIN = {"architectures": "fw.architectures", "backends": "fw.backends", "quantizers": "fw.quantizers"}


def _all_names(package: str) -> set[str]:
    """The names in a core package's `__all__` list, read from its source."""
    path = ROOT / "core" / Path(*package.split(".")[1:]) / "__init__.py"
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return {e.value for e in node.value.elts if isinstance(e, ast.Constant)}
    raise AssertionError(f"{path} has no __all__")


def _sources() -> list[tuple[Path, str, str]]:
    """(file, its module name, the plugin package it belongs to) for every plugin source file."""
    out = []
    for folder, package in BUILTIN.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            module = ".".join([package, *(parts[:-1] if parts[-1] == "__init__" else parts)])
            out.append((path, module, package))
    for dist in sorted((ROOT / "plugins").iterdir()):
        for top in sorted(p for p in dist.iterdir() if (p / "__init__.py").is_file()):
            for path in sorted(top.rglob("*.py")):
                parts = list(path.relative_to(dist).with_suffix("").parts)
                out.append((path, ".".join(parts[:-1] if parts[-1] == "__init__" else parts), top.name))
    return out


def _imports(path: Path, module: str) -> list[tuple[int, str, str | None]]:
    """(line, imported module, imported name or None) for each fw import in the file."""
    return [(node.lineno, target, name) for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, (ast.Import, ast.ImportFrom))
            for target, name in import_graph.imported(module, path.name == "__init__.py", node)
            if target.split(".")[0].startswith("fw")]


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _allowed(source: str, own: str, target: str, name: str | None) -> bool:
    if _within(target, own):  # the plugin's own modules (a built-in family shares its package's helpers)
        return True
    full = f"{target}.{name}" if name else target
    if any(_within(full, m) or target == m for m in API_MODULES):
        return True
    if target in API_PACKAGES and (name is None or name in _all_names(target)):
        return True
    return any(_within(source, who) and (_within(full, what) or target == what) for who, what in EXCEPTIONS)


def _own(module: str, package: str) -> str:
    """A built-in plugin's own package: its kind's folder (fw.backends.grammar), or fw.quantizers /
    fw.architectures; a plugin distribution's top-level package."""
    if package == "fw.backends":
        return ".".join(module.split(".")[:3])
    return package


def test_plugins_import_only_the_plugin_api():
    found = []
    for path, module, package in _sources():
        for line, target, name in _imports(path, module):
            if not _allowed(module, _own(module, package), target, name):
                found.append(f"{path.relative_to(ROOT)}:{line}: {target}" + (f" import {name}" if name else ""))
    assert not found, ("plugins import fw outside the documented plugin API (docs/plugin-api.md): expose what "
                       "they need through the API, or list a reasoned exception in this test:\n" + "\n".join(found))


def test_the_walk_sees_a_violation_and_the_exceptions_are_used():
    assert not _allowed("fw.backends.sampling.builtin", "fw.backends.sampling", "fw.layers", "cpu_ops")
    assert not _allowed("fw.backends.grammar.xgrammar_backend", "fw.backends.grammar", "fw.warm.grammar",
                        "KeptGrammars")
    assert not _allowed("fw.backends.attention.sdpa", "fw.backends.attention", "fw.quantizers.gguf", None)
    assert _allowed("fw.backends.grammar.xgrammar_backend", "fw.backends.grammar", "fw.grammar", "KeptGrammars")
    used = {(who, what) for path, module, package in _sources() for _, target, name in _imports(path, module)
            for who, what in EXCEPTIONS
            if _within(module, who) and (target == what or _within(f"{target}.{name}", what))}
    assert used == set(EXCEPTIONS), f"exceptions no plugin needs any more (drop them): {set(EXCEPTIONS) - used}"
