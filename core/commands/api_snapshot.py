"""A snapshot of the stable plugin API, so a change to it cannot ship without a version bump.

The stable surface (docs/plugin-api.md) is flattened into one entry per hook, type, member,
parameter, export and constant, each with a short description: ``"use fw.plugins.specs.SamplerSpec(order)":
"#3 pos/kw: int = 100"``. The committed snapshot (docs/plugin-api-snapshot.json) holds the entries for
one `PLUGIN_API_VERSION`; tests/test_plugin_api.py recomputes them and fails when they differ
while the version did not move, saying what changed and which bump it needs:

- major: something plugins rely on was removed or changed, or a parameter was added that existing
  plugins cannot supply or do not accept (a required parameter; any parameter of a hook or of an
  interface plugins implement, since the core calls implementations with every argument);
- minor: only additions (a hook, a type, a member, an optional parameter of something plugins call),
  or a type given to an untyped parameter of something plugins call (`Any` -> the type its docstring stated).

Regenerate after bumping (from the checkout's root)::

    python -m fw.commands.api_snapshot --write      # refuses when the bump is too small for the diff
    python -m fw.commands.api_snapshot --check      # what the test checks; exit 1 with the report
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Iterable

from fw import version  # version.PLUGIN_API_VERSION is read at each call (a test bumps it)
from fw.plugins import hookspecs

SNAPSHOT_PATH = Path("docs/plugin-api-snapshot.json")
REGENERATE = "python -m fw.commands.api_snapshot --write"

# (dotted name, role). "impl": plugins implement it, so the core calls into plugin code with this
# signature; "use": plugins construct, call or read it.
STABLE_TYPES: tuple[tuple[str, str], ...] = (
    # what plugins register (fw.plugins)
    ("fw.plugins.specs.ArchitectureSpec", "use"),
    ("fw.plugins.specs.AttentionBackendSpec", "use"),
    ("fw.plugins.specs.AttentionRequirements", "use"),
    ("fw.plugins.specs.MoeKernelSpec", "use"),
    ("fw.plugins.specs.MoeRequirements", "use"),
    ("fw.plugins.specs.QuantizationMethodSpec", "use"),
    ("fw.plugins.specs.SamplerSpec", "use"),
    ("fw.plugins.specs.GrammarBackendSpec", "use"),
    ("fw.plugins.specs.ToolParserSpec", "use"),
    ("fw.plugins.specs.CliCommandSpec", "use"),
    ("fw.plugins.specs.ProposerSpec", "use"),
    ("fw.plugins.specs.ExecutorSpec", "use"),
    ("fw.plugins.specs.Verified", "use"),
    # the interfaces plugins implement
    ("fw.plugins.specs.ArchitectureBuild", "impl"),
    ("fw.plugins.specs.SamplerStage", "impl"),
    ("fw.plugins.specs.PerRequestSamplerStage", "impl"),
    ("fw.plugins.specs.SamplerChoice", "impl"),
    ("fw.layers.attention.AttentionBackend", "impl"),
    ("fw.layers.linear.LinearMethod", "impl"),
    ("fw.layers.moe.MoeKernel", "impl"),
    ("fw.grammar.contract.GrammarCompiler", "impl"),
    ("fw.grammar.contract.CompiledGrammar", "impl"),
    ("fw.grammar.contract.GrammarMatcher", "impl"),
    ("fw.tool_parsing.ToolParser", "impl"),
    ("fw.warm.artifact.WarmArtifact", "impl"),
    ("fw.speculative.contract.Proposer", "impl"),
    ("fw.plugins.executor.Executor", "impl"),
    ("fw.plugins.executor.WorkerProcess", "impl"),
    # what the core hands to plugins
    ("fw.model.config.ModelConfig", "use"),
    ("fw.model.config.RopeConfig", "use"),
    ("fw.model.config.MoeConfig", "use"),
    ("fw.model_config.ModelConfig", "use"),  # deprecated since 1.10: a re-export of fw.model.config's
    ("fw.model_config.RopeConfig", "use"),
    ("fw.model_config.MoeConfig", "use"),
    ("fw.layers.attention.AttentionMetadata", "use"),
    ("fw.layers.context.ModelContext", "use"),
    ("fw.sampling.batch.SamplingBatch", "use"),
    ("fw.sampling.batch.argmax", "use"),
    ("fw.sampling.params.SamplingParams", "use"),
    ("fw.sampling.params.SamplerRequest", "use"),
    ("fw.grammar.constraint.Constraint", "use"),
    ("fw.grammar.tokenizer.GrammarTokenizer", "use"),
    ("fw.grammar.contract.GrammarError", "use"),
    ("fw.grammar.kept.KeptGrammars", "use"),
    ("fw.tool_parsing.ToolCall", "use"),
    ("fw.warm.artifact.WarmItem", "use"),
    ("fw.warm.artifact.WarmContext", "use"),
    ("fw.speculative.contract.ProposerContext", "use"),
    ("fw.speculative.contract.DraftRequest", "use"),
    ("fw.speculative.contract.Draft", "use"),
    ("fw.plugins.executor.WorkerLaunch", "use"),
    # the building blocks architecture plugins are made of (fw.layers)
    ("fw.layers.linear.Linear", "use"),
    ("fw.layers.linear.UnquantizedLinearMethod", "use"),
    ("fw.layers.attention.Attention", "use"),
    ("fw.layers.norm.RMSNorm", "use"),
    ("fw.layers.rotary.RotaryEmbedding", "use"),
    ("fw.layers.rotary.apply_rotary", "use"),
    ("fw.layers.blocks.SelfAttention", "use"),
    ("fw.layers.blocks.GatedMLP", "use"),
    ("fw.layers.blocks.PreNormDecoderLayer", "use"),
    ("fw.layers.blocks.PostNormDecoderLayer", "use"),
    ("fw.layers.blocks.DecoderModel", "use"),
    ("fw.layers.causal_lm.CausalLM", "use"),
    ("fw.layers.weights.load_named_weights", "use"),
    ("fw.layers.moe.SparseMoeBlock", "use"),
    ("fw.layers.moe.FusedExperts", "use"),
    ("fw.layers.moe.load_moe_weights", "use"),
    ("fw.layers.moe.topk_routing", "use"),
    # how a plugin builds and loads its C++ kernels (docs/plugin-authors/loading.md)
    ("fw.kernels.loader.load_cpp_ops", "use"),
    ("fw.kernels.loader.unavailable", "use"),
    ("fw.cpp_ops.load_cpp_ops", "use"),  # deprecated since 1.10: a re-export of fw.kernels.loader's
    ("fw.cpp_ops.unavailable", "use"),
    # the test kit plugin authors' tests call (docs/plugin-testing.md#helpers)
    ("fw.testing.suite.conformance_suite", "use"),
    ("fw.testing.models.tokenizer", "use"),
    ("fw.testing.models.make_config", "use"),
    ("fw.testing.models.build_model", "use"),
    ("fw.testing.models.randomize", "use"),
    ("fw.testing.models.tiny_checkpoint", "use"),
    ("fw.testing.models.load_reference", "use"),
    ("fw.testing.models.greedy_reference", "use"),
    ("fw.testing.sequences.FakeSequence", "use"),
    ("fw.testing.pipeline.sampler_pipeline", "use"),
    # errors plugins raise and catch
    ("fw.errors.FwError", "use"),
    ("fw.errors.ConfigError", "use"),
    ("fw.errors.PluginError", "use"),
    ("fw.errors.PluginLoadError", "use"),
    ("fw.errors.DuplicatePluginNameError", "use"),
    ("fw.errors.UnknownImplementationError", "use"),
    ("fw.errors.UnsupportedConfigurationError", "use"),
    ("fw.errors.ModelLoadError", "use"),
    ("fw.errors.UnsupportedArchitectureError", "use"),
    ("fw.errors.InvalidRequestError", "use"),
    ("fw.errors.PromptTooLongError", "use"),
)

# Modules whose public names (`__all__`) plugins import: removing one breaks them.
STABLE_MODULES: tuple[str, ...] = ("fw.plugins", "fw.layers", "fw.grammar", "fw.warm", "fw.speculative",
                                   "fw.testing")

# Values plugins compare against or name in their pyproject.
STABLE_CONSTANTS: tuple[str, ...] = (
    "fw.plugins.hookspecs.PROJECT_NAME",
    "fw.plugins.hookspecs.ENTRY_POINT_GROUP",
    "fw.plugins.specs.KINDS",
    "fw.grammar.constraint.CONSTRAINT_KINDS",
)

_KINDS = {
    inspect.Parameter.POSITIONAL_ONLY: "pos",
    inspect.Parameter.POSITIONAL_OR_KEYWORD: "pos/kw",
    inspect.Parameter.VAR_POSITIONAL: "*args",
    inspect.Parameter.KEYWORD_ONLY: "kw",
    inspect.Parameter.VAR_KEYWORD: "**kwargs",
}


# -- computing the entries -----------------------------------------------------------------------


def _resolve(dotted: str) -> Any:
    """`a.b.c.Name` -> the object (the longest importable module prefix, then attributes)."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"cannot resolve {dotted!r}")


def _annotation(ann: Any) -> str:
    if ann is inspect.Parameter.empty or ann is inspect.Signature.empty:
        return ""
    return ann if isinstance(ann, str) else inspect.formatannotation(ann)


def _value(value: Any) -> str:
    """A default or class attribute as text: literals by repr, anything else by its type."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, (tuple, list, frozenset)) and all(
            v is None or isinstance(v, (bool, int, float, str)) for v in value):
        return repr(value)
    if type(value).__name__ == "dtype":  # torch.float32
        return str(value)
    if type(value).__name__ == "_HAS_DEFAULT_FACTORY_CLASS":  # a dataclass field's default_factory
        return "<factory>"
    return f"<{type(value).__name__}>"


def _signature_entries(key: str, func: Any, drop_first: bool = False, returns: bool = True) -> dict[str, str]:
    """One entry per parameter (`key(name)`) and one for the return annotation (`key ->`)."""
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):  # builtins without a signature (Exception's constructor)
        return {}
    params = list(sig.parameters.values())[1 if drop_first else 0:]
    out = {}
    for i, p in enumerate(params):
        ann = _annotation(p.annotation)
        text = f"#{i} {_KINDS[p.kind]}" + (f": {ann}" if ann else "")
        if p.default is not inspect.Parameter.empty:
            text += f" = {_value(p.default)}"
        elif p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            text += ", required"
        out[f"{key}({p.name})"] = text
    ret = _annotation(sig.return_annotation) if returns else ""
    if ret:
        out[f"{key} ->"] = ret
    return out


def _is_protocol(cls: type) -> bool:
    return bool(getattr(cls, "_is_protocol", False))


def _class_entries(key: str, cls: type) -> dict[str, str]:
    if dataclasses.is_dataclass(cls):
        frozen = cls.__dataclass_params__.frozen  # type: ignore[attr-defined]
        head = "dataclass(frozen)" if frozen else "dataclass"
    elif _is_protocol(cls):
        head = "protocol"
    else:
        head = "class"
    bases = [b.__name__ for b in cls.__bases__ if b is not object and b.__name__ not in ("Protocol", "Generic")]
    out = {key: head + (f"({', '.join(bases)})" if bases else "")}
    own = vars(cls)
    if dataclasses.is_dataclass(cls) or ("__init__" in own and not _is_protocol(cls)):
        out.update(_signature_entries(key, cls, returns=False))  # the constructor, as plugins or the core call it
    for name, ann in own.get("__annotations__", {}).items():
        if not name.startswith("_") and not dataclasses.is_dataclass(cls):
            value = own.get(name, dataclasses.MISSING)
            out[f"{key}.{name}"] = f"attribute: {_annotation(ann)}" + (
                "" if value is dataclasses.MISSING else f" = {_value(value)}")
    for name, member in own.items():
        if name.startswith("_") or f"{key}.{name}" in out:
            continue
        if dataclasses.is_dataclass(cls) and name in {f.name for f in dataclasses.fields(cls)}:
            continue  # a field's default: the constructor entry has it
        member_key = f"{key}.{name}"
        if isinstance(member, staticmethod):
            out[member_key] = "staticmethod"
            out.update(_signature_entries(member_key, member.__func__))
        elif isinstance(member, classmethod):
            out[member_key] = "classmethod"
            out.update(_signature_entries(member_key, member.__func__, drop_first=True))
        elif isinstance(member, property) or type(member).__name__ == "cached_property":
            out[member_key] = "property"
        elif inspect.isfunction(member):
            out[member_key] = "method"
            out.update(_signature_entries(member_key, member, drop_first=True))
        else:
            out[member_key] = f"attribute = {_value(member)}"
    return out


def _hook_entries(module: ModuleType) -> dict[str, str]:
    out = {}
    marker = f"{module.PROJECT_NAME}_spec"
    for name, func in vars(module).items():
        opts = getattr(func, marker, None)
        if opts is None or not inspect.isfunction(func):
            continue
        flags = [flag for flag in ("firstresult", "historic") if opts.get(flag)]
        out[f"hook {name}"] = "hookspec" + (f" ({', '.join(flags)})" if flags else "")
        out.update(_signature_entries(f"hook {name}", func))
    return out


def compute_entries(hookspec_module: ModuleType | None = None,
                    types: Iterable[tuple[str, str]] = STABLE_TYPES) -> dict[str, str]:
    """The flattened stable API of the code as it is now, sorted by key."""
    if hookspec_module is None:
        hookspec_module = hookspecs
    out = _hook_entries(hookspec_module)
    for dotted, role in types:
        obj = _resolve(dotted)
        key = f"{role} {dotted}"
        if inspect.isclass(obj):
            out.update(_class_entries(key, obj))
        else:
            out[key] = "function"
            out.update(_signature_entries(key, obj))
    for module_name in STABLE_MODULES:
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", ()):
            out[f"export {module_name}.{name}"] = "exported"
    for dotted in STABLE_CONSTANTS:
        value = _resolve(dotted)
        if isinstance(value, (tuple, list)):
            out[f"const {dotted}"] = "tuple"
            out.update({f"const {dotted}[{item!r}]": "member" for item in value})
        else:
            out[f"const {dotted}"] = _value(value)
    return dict(sorted(out.items()))


def snapshot(hookspec_module: ModuleType | None = None) -> dict[str, Any]:
    return {"api_version": version.PLUGIN_API_VERSION, "regenerate": REGENERATE,
            "entries": compute_entries(hookspec_module)}


# -- comparing -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Change:
    key: str
    what: str  # "added", "removed", "changed"
    old: str | None
    new: str | None
    breaking: bool

    def __str__(self) -> str:
        level = "BREAKING" if self.breaking else "additive"
        if self.what == "changed":
            return f"{level}: {'typed' if not self.breaking else 'changed'} {self.key}: {self.old!r} -> {self.new!r}"
        return f"{level}: {self.what} {self.key}" + (f" ({self.new})" if self.new else "")


def _added_breaks(key: str, value: str, old: dict[str, str]) -> bool:
    """An addition breaks plugins when it is a parameter of something that already existed which
    they cannot supply (required) or which the core passes into their code (a hook's, or one of a
    method of an interface they implement)."""
    if "(" not in key or key.split("(")[0] not in old:
        return False  # a new hook, type, member, export or constant, with its parameters
    return key.startswith(("hook ", "impl ")) or value.endswith(", required")


def _split_annotation(entry: str) -> tuple[str, str]:
    """A parameter entry without its annotation, and the annotation ("" when none)."""
    head, sep, rest = entry.partition(" = ")
    tail = sep + rest
    if not sep and head.endswith(", required"):
        head, tail = head.removesuffix(", required"), ", required"
    where, _, annotation = head.partition(": ")
    return where + tail, annotation


def _typed_only(key: str, old: str, new: str) -> bool:
    """A parameter of something plugins call (not a hook's, not an implemented interface's) that
    gains the type its docstring already stated: no annotation, `Any`, or `Callable[..., Any]`
    before, or an annotation whose `Any`s the new one fills in (`Callable[[], Any]` ->
    `Callable[[], MoeKernel]`). The values accepted at run time do not change."""
    if "(" not in key or key.startswith(("hook ", "impl ")):
        return False
    (old_rest, old_ann), (new_rest, new_ann) = _split_annotation(old), _split_annotation(new)
    if old_rest != new_rest or not new_ann:
        return False
    if old_ann in ("", "Any", "Callable[..., Any]"):
        return True
    if "Any" not in old_ann:
        return False
    return re.fullmatch(".+".join(re.escape(part) for part in old_ann.split("Any")), new_ann) is not None


def diff(old: dict[str, str], new: dict[str, str]) -> list[Change]:
    changes = []
    for key in sorted(old.keys() | new.keys()):
        if key not in new:
            changes.append(Change(key, "removed", old[key], None, True))
        elif key not in old:
            changes.append(Change(key, "added", None, new[key], _added_breaks(key, new[key], old)))
        elif old[key] != new[key]:
            changes.append(Change(key, "changed", old[key], new[key], not _typed_only(key, old[key], new[key])))
    return changes


def _version(text: str) -> tuple[int, int]:
    major, minor = (int(x) for x in str(text).split(".")[:2])
    return major, minor


def needed_bump(changes: list[Change]) -> str:
    return "major" if any(c.breaking for c in changes) else "minor" if changes else "none"


def suggested_version(current: str, bump: str) -> str:
    major, minor = _version(current)
    return f"{major + 1}.0" if bump == "major" else f"{major}.{minor + 1}"


def bump_problem(committed: dict[str, Any], current: dict[str, Any]) -> str | None:
    """Why the version in `current` does not fit the changes since `committed`, or None."""
    changes = diff(committed["entries"], current["entries"])
    need = needed_bump(changes)
    old_v, new_v = committed["api_version"], current["api_version"]
    listing = "\n".join(f"  {c}" for c in changes)
    if old_v == new_v:
        if not changes:
            return None
        return (f"The stable plugin API changed, but PLUGIN_API_VERSION is still {new_v}:\n{listing}\n"
                f"This needs a {need} bump: set PLUGIN_API_VERSION = \"{suggested_version(new_v, need)}\" in "
                f"core/version.py, say what changed in docs/plugin-api.md, then regenerate the snapshot with "
                f"`{REGENERATE}` (from the checkout's root). If the change was not meant to reach plugins, undo it.")
    (o_major, o_minor), (n_major, n_minor) = _version(old_v), _version(new_v)
    if (n_major, n_minor) < (o_major, o_minor):
        return f"PLUGIN_API_VERSION went backwards ({old_v} -> {new_v}); versions only grow."
    if need == "major" and n_major == o_major:
        return (f"PLUGIN_API_VERSION {old_v} -> {new_v} is a minor bump, but these changes break plugins:\n"
                f"{listing}\nBump to {suggested_version(old_v, 'major')} (plugins built for {o_major}.x are then "
                f"refused), or keep the old spelling working and deprecate it (docs/plugin-api.md, Deprecations).")
    return None


def check(committed: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Everything wrong with the committed snapshot against the code (empty: up to date)."""
    problem = bump_problem(committed, current)
    if problem:
        return [problem]
    if committed != current:
        return [f"docs/plugin-api-snapshot.json is for plugin API {committed['api_version']}, the code is "
                f"{current['api_version']}: regenerate it with `{REGENERATE}` (from the checkout's root)."]
    return []


def load(path: Path = SNAPSHOT_PATH) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def dump(snap: dict[str, Any]) -> str:
    return json.dumps(snap, indent=1, sort_keys=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fw.commands.api_snapshot", description=__doc__.split("\n")[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", action="store_true", help="Write the snapshot (refused if the version bump "
                                                             "does not cover the changes).")
    action.add_argument("--check", action="store_true", help="Exit 1 if the snapshot is out of date.")
    action.add_argument("--print", action="store_true", help="Print the snapshot of the code as it is.")
    parser.add_argument("--path", type=Path, default=SNAPSHOT_PATH, help=f"Snapshot file (default {SNAPSHOT_PATH}).")
    args = parser.parse_args(argv)
    current = snapshot()
    if args.print:
        sys.stdout.write(dump(current))
        return 0
    committed = load(args.path) if args.path.is_file() else None
    if args.check:
        problems = ["no snapshot at " + str(args.path)] if committed is None else check(committed, current)
        for problem in problems:
            print(problem, file=sys.stderr)
        return 1 if problems else 0
    problem = bump_problem(committed, current) if committed is not None else None
    if problem:
        print(f"not written: {problem}", file=sys.stderr)
        return 1
    args.path.write_text(dump(current))
    print(f"wrote {args.path} (plugin API {current['api_version']}, {len(current['entries'])} entries)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
