"""Gathers every warm-cache artifact for one context: the core's (model files,
GGUF tokenizer, fused C++ ops), each plugin's (through the
`fw_warm_cache_artifacts` hook, attributed to the plugin), and the compiled
model steps of `fw.compile` (fw.commands.warm_cache.compiled).

Order matters and is fixed: the model's files come first (everything else
needs them), plugin kernels before compiled steps (a compile runs the model,
which loads the kernels). A plugin whose hook raises is reported as a failed
contribution, and the others still run."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
from dataclasses import dataclass
from functools import partial

from fw.commands.warm_cache.model import GgufTokenizerArtifact, ModelFilesArtifact, ModelRecordsArtifact
from fw.warm.artifact import WarmArtifact, WarmContext
from fw.warm.cpp import core_cpu_ops, core_dense_bf16, core_packed_int, core_step_program

logger = logging.getLogger("fw.warm")

COMPILE_MODULE = "fw.commands.warm_cache.compiled"  # exposes warm_artifacts(context) -> list[WarmArtifact]
COMPILE_OWNER = "fw.compile"  # whose artifacts they are: the report's label


@dataclass
class Contribution:
    """One artifact with the plugin (or core component) it came from, or a contributor's failure."""

    owner: str
    artifact: WarmArtifact | None = None
    error: str | None = None


def collect(context: WarmContext) -> list[Contribution]:
    out = [Contribution("core", ModelFilesArtifact()), Contribution("core", GgufTokenizerArtifact()),
           Contribution("core", ModelRecordsArtifact()),
           Contribution("core", core_cpu_ops()), Contribution("core", core_dense_bf16()),
           Contribution("core", core_packed_int()), Contribution("core", core_step_program())]
    out += _from_plugins(context)
    out += _from_compile(context)
    out += _unclaimed_grammar_backends(context, out)
    return out


def _from_plugins(context: WarmContext) -> list[Contribution]:
    plugins = context.plugins
    out: list[Contribution] = []
    for name, add_artifacts in plugins.hook_implementations("fw_warm_cache_artifacts"):
        info = plugins.plugins.get(name)
        if info is not None and (info.error or info.disabled):
            continue
        added: list[Contribution] = []
        try:
            add_artifacts(context=context, add=partial(_add, added, name))
        except Exception as exc:  # one broken plugin must not stop the others' warm-up
            logger.debug("fw_warm_cache_artifacts of %s raised", name, exc_info=True)
            added = [Contribution(name, error=f"its fw_warm_cache_artifacts hook raised "
                                              f"{type(exc).__name__}: {exc}")]
        out += added
    return out


def _add(into: list[Contribution], plugin: str, artifact: WarmArtifact) -> None:
    if not isinstance(artifact, WarmArtifact):
        raise TypeError(f"add() takes a fw.warm.WarmArtifact (name, owner, check, build), "
                        f"got {type(artifact).__name__}")
    if not getattr(artifact, "owner", None):
        artifact.owner = plugin
    into.append(Contribution(plugin, artifact))


def _from_compile(context: WarmContext) -> list[Contribution]:
    """The compiled model steps (fw.commands.warm_cache.compiled)."""
    if not _installed(COMPILE_MODULE):
        return []
    try:
        module = importlib.import_module(COMPILE_MODULE)
        make = getattr(module, "warm_artifacts", None)
        artifacts = make(context) if make is not None else []
    except Exception as exc:
        logger.debug("%s.warm_artifacts raised", COMPILE_MODULE, exc_info=True)
        return [Contribution(COMPILE_OWNER, error=f"warm_artifacts raised {type(exc).__name__}: {exc}")]
    return [Contribution(getattr(a, "owner", None) or COMPILE_OWNER, a) for a in artifacts]


def _installed(module: str) -> bool:
    if module in sys.modules:
        return True
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _unclaimed_grammar_backends(context: WarmContext, so_far: list[Contribution]) -> list[Contribution]:
    """--warm-schemas entries for a backend that added no grammar artifact of its own: compiled by the
    core to validate them (reported as misses: nothing is kept)."""
    if not context.options.get("warm_schemas"):
        return []
    from fw.warm.grammar import GrammarWarmArtifact, warm_constraints  # here: 0.14 s (jsonschema); --warm-schemas only

    claimed = {c.artifact.backend for c in so_far if isinstance(c.artifact, GrammarWarmArtifact)}
    return [Contribution("core", GrammarWarmArtifact(backend, owner="core"))
            for backend in warm_constraints(context) if backend not in claimed]
