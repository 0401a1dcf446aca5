"""Precompiled grammars for `fw warm-cache --warm-schemas FILE`.

The file lists the constraints a deployment expects (JSON schemas, regexes,
choices, grammars). Each entry goes to the grammar backend the server would
pick for it (the entry's own `backend`, else `--grammar-backend`, else auto),
and that backend's compiler stores the compiled form in a `GrammarStore`
under fw's cache dir, keyed by the backend and its version, fw's version, the
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

import hashlib
import json
import logging
import os
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, TypeVar

from fw.errors import ConfigError, FwError
from fw.paths import cache_dir
from fw.warm.artifact import WarmContext, WarmItem

logger = logging.getLogger("fw.warm")

T = TypeVar("T")

_PARAM_KEYS = {"json", "regex", "choice", "grammar", "json_object", "backend"}


def store_root(backend: str) -> Path:
    return cache_dir() / "grammars" / backend


class GrammarStore:
    """Compiled grammars of one backend kept on disk across processes: one file per constraint,
    written with an atomic rename so concurrent writers and readers never see half a file.
    `version` must change whenever the backend's compiled form or compile options change."""

    def __init__(self, backend: str, version: str, tokenizer: Any):
        from fw.version import __version__

        self.backend = backend
        self.root = store_root(backend)
        self._salt = [backend, version, __version__, tokenizer.cache_key]

    def path(self, constraint: Any) -> Path:
        text = json.dumps([*self._salt, constraint.kind, constraint.value])
        return self.root / f"{hashlib.sha256(text.encode()).hexdigest()[:32]}.bin"

    def has(self, constraint: Any) -> bool:
        return self.path(constraint).is_file()

    def load(self, constraint: Any) -> bytes | None:
        try:
            return self.path(constraint).read_bytes()
        except OSError:
            return None

    def save(self, constraint: Any, data: bytes) -> Path:
        path = self.path(constraint)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path


class KeptGrammars:
    """A grammar compiler's kept grammars: its `GrammarStore`, opened at first use (keying it hashes
    the vocabulary, which a server that never warmed anything should not pay) from any thread, and
    an entry this build cannot read (another library version, a damaged file) is compiled instead."""

    def __init__(self, backend: str, version: Callable[[], str], tokenizer: Any):
        self.backend = backend
        self._version = version  # called once, when the store is opened
        self._tokenizer = tokenizer
        self._store: GrammarStore | None = None
        self._lock = threading.Lock()  # compiles run on the grammar service's worker thread

    @property
    def store(self) -> GrammarStore:
        with self._lock:
            if self._store is None:
                self._store = GrammarStore(self.backend, self._version(), self._tokenizer)
            return self._store

    def has(self, constraint: Any) -> bool:
        return self.store.has(constraint)

    def save(self, constraint: Any, data: bytes) -> Path:
        return self.store.save(constraint, data)

    def load(self, constraint: Any, decode: Callable[[bytes], T]) -> T | None:
        """`decode` of what fw warm-cache kept for `constraint`, or None (nothing kept, or unreadable)."""
        if not store_in_use(self.backend):  # nothing was ever warmed: skip hashing the vocabulary
            return None
        data = self.store.load(constraint)
        if not data:
            return None
        try:
            return decode(data)
        except Exception as exc:  # noqa: BLE001 - any failure to read it back means: compile instead
            logger.warning("%s: ignoring the kept compiled form of %s (%s); compiling it", self.backend,
                           constraint.describe(), exc)
            return None


def size_text(n: int) -> str:
    """12345 -> '12.3 kB', for report lines."""
    return f"{n} B" if n < 1000 else f"{n / 1e3:.1f} kB" if n < 1e6 else f"{n / 1e6:.1f} MB"


def store_in_use(backend: str) -> bool:
    """Whether anything was ever warmed for `backend` (servers skip hashing the vocabulary otherwise)."""
    return store_root(backend).is_dir()


# -- the --warm-schemas file -----------------------------------------------------------------------


def read_warm_schemas(path: Path) -> list[Any]:
    """`StructuredOutputsParams` for each entry of the file: a JSON list whose entries are a JSON
    schema, an object with one of json / regex / choice / grammar / json_object (and optionally
    backend), or an OpenAI response_format object of type json_schema."""
    from fw.grammar.constraint import StructuredOutputsParams

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
    from fw.plugins.selection import select_grammar_backend

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
        from fw.warm import resolve

        key = f"grammar_compiler:{self.backend}"
        if key not in context.memo:
            tokenizer = resolve.grammar_tokenizer(context)
            if tokenizer is None:
                return None
            context.memo[key] = context.plugins.registry("grammar_backend").get(self.backend).factory(tokenizer)
        return context.memo[key]


def _persists(compiler: Any) -> bool:
    return callable(getattr(compiler, "persisted", None)) and callable(getattr(compiler, "persist", None))
