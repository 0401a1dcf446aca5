"""Precompiled grammars for `fw warm-cache --warm-schemas FILE`.

The file lists the constraints a deployment expects (JSON schemas, regexes,
choices, grammars). Each entry goes to the grammar backend the server would
pick for it (the entry's own `backend`, else `--grammar-backend`, else auto),
and that backend's compiler stores the compiled form in a `GrammarStore`
(fw.grammar.kept) under fw's cache dir, keyed by the backend and its version, fw's version, the
vocabulary (`GrammarTokenizer.cache_key`) and the constraint; the server's
compiler looks there before compiling, so a schema listed at warm-up costs a
file read instead of a compile at its first request.

A grammar backend opts in by giving its compiler two methods (see
docs/warm-cache.md): `persisted(constraint) -> bool` (cheap, builds nothing)
and `persist(constraint) -> None` (compile and store, raising GrammarError for
a constraint it cannot compile), and by adding `GrammarWarmArtifact(NAME)`
through the `fw_warm_cache_artifacts` hook. A backend without them is still
warmed by the core: its constraints are compiled once to validate them, and
reported as misses, since nothing is kept across processes."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from fw.errors import ConfigError, FwError
from fw.grammar.constraint import StructuredOutputsParams
# the kept-grammar store moved to fw.grammar.kept (serving reads it); its names stay importable from here
from fw.grammar.kept import GrammarStore, KeptGrammars, size_text, store_in_use, store_root  # noqa: F401
from fw.plugins.selection import select_grammar_backend
from fw.warm import resolve
from fw.warm.artifact import WarmContext, WarmItem

logger = logging.getLogger("fw.warm")

_PARAM_KEYS = {"json", "regex", "choice", "grammar", "json_object", "backend"}


# -- the --warm-schemas file -----------------------------------------------------------------------


def read_warm_schemas(path: Path) -> list[Any]:
    """`StructuredOutputsParams` for each entry of the file: a JSON list whose entries are a JSON
    schema, an object with one of json / regex / choice / grammar / json_object (and optionally
    backend), or an OpenAI response_format object of type json_schema."""
    where = f"--warm-schemas {path}"
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read it ({exc})") from None
    except ValueError as exc:
        raise ConfigError(f"{where}: not valid JSON ({exc})") from None
    if isinstance(data, dict) and isinstance(data.get("schemas"), list):
        data = data["schemas"]
    if not isinstance(data, list):
        raise ConfigError(f"{where}: expected a JSON list of schemas (or {{\"schemas\": [...]}})")
    out = []
    for i, entry in enumerate(data):
        try:
            out.append(StructuredOutputsParams(**_entry_fields(entry)))
        except (FwError, TypeError) as exc:
            raise ConfigError(f"{where}: entry {i}: {exc}") from None
    return out


def _entry_fields(entry: Any) -> dict:
    if isinstance(entry, dict) and entry.get("type") == "json_schema" and isinstance(entry.get("json_schema"), dict):
        return {"json": entry["json_schema"].get("schema", {})}  # an OpenAI response_format
    if isinstance(entry, dict) and entry and set(entry) <= _PARAM_KEYS and set(entry) != {"backend"}:
        return dict(entry)
    if isinstance(entry, (dict, bool)):
        return {"json": entry}
    raise TypeError(f"expected a JSON schema or an object with json/regex/choice/grammar/json_object, "
                    f"got {type(entry).__name__}")


def warm_constraints(context: WarmContext) -> dict[str, list[Any]]:
    """Backend name -> the distinct constraints of --warm-schemas that the server would send it
    (ConfigError for an entry no installed backend supports)."""
    if "warm_constraints" in context.memo:
        return context.memo["warm_constraints"]

    by_backend: dict[str, list[Any]] = {}
    path = context.options.get("warm_schemas")
    if path:
        registry = context.plugins.registry("grammar_backend")
        for i, params in enumerate(read_warm_schemas(Path(path))):
            constraint = params.constraint()
            try:
                backend = select_grammar_backend(registry, constraint.kind,
                                                 params.backend or context.config.grammar_backend).chosen.name
            except FwError as exc:
                raise ConfigError(f"--warm-schemas {path}: entry {i}: {exc}") from None
            if constraint not in by_backend.setdefault(backend, []):
                by_backend[backend].append(constraint)
    context.memo["warm_constraints"] = by_backend
    return by_backend


# -- the artifact ------------------------------------------------------------------------------------


class GrammarWarmArtifact:
    """The constraints of --warm-schemas that go to `backend`, compiled and stored by its compiler."""

    def __init__(self, backend: str, owner: str | None = None):
        self.backend = backend
        self.name = f"grammars {backend}"
        self.owner = owner or backend

    def check(self, context: WarmContext) -> list[WarmItem]:
        constraints = warm_constraints(context).get(self.backend, [])
        compiler = self._compiler(context) if constraints else None
        if compiler is None:
            return [WarmItem(c.describe(60), False, "needs the model's tokenizer first") for c in constraints]
        if not _persists(compiler):
            return [WarmItem(c.describe(60), False, f"{self.backend} keeps no compiled grammars across processes")
                    for c in constraints]
        return [WarmItem(c.describe(60), compiler.persisted(c), "") for c in constraints]

    def build(self, context: WarmContext) -> list[WarmItem]:
        constraints = warm_constraints(context).get(self.backend, [])
        if not constraints:
            return []
        compiler = self._compiler(context)
        if compiler is None:
            raise FwError("the model's tokenizer is needed to compile grammars, and the model files are missing")
        items, errors = [], []
        for c in constraints:
            try:
                if not _persists(compiler):
                    compiler.compile(c)
                    items.append(WarmItem(c.describe(60), False, "compiled to validate it; not kept across processes"))
                elif compiler.persisted(c):
                    items.append(WarmItem(c.describe(60), True, ""))
                else:
                    detail = compiler.persist(c)
                    items.append(WarmItem(c.describe(60), False, detail or "compiled and kept"))
            except FwError as exc:
                errors.append(str(exc))
        if errors:
            raise FwError("; ".join(errors))
        return items

    def _compiler(self, context: WarmContext) -> Any:
        key = f"grammar_compiler:{self.backend}"
        if key not in context.memo:
            tokenizer = resolve.grammar_tokenizer(context)
            if tokenizer is None:
                return None
            context.memo[key] = context.plugins.registry("grammar_backend").get(self.backend).factory(tokenizer)
        return context.memo[key]


def _persists(compiler: Any) -> bool:
    return callable(getattr(compiler, "persisted", None)) and callable(getattr(compiler, "persist", None))
