"""Compiles requests' constraints (cached, on a worker thread) and fills the
per-step token bitmask for the sequences that have a grammar.

One per engine. `compile_async` is what the server awaits before it hands a
request to the engine thread, so a slow compile never stalls other requests'
steps; the engine's own `compile` is then a cache hit."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import OrderedDict
from typing import Any, Sequence

import torch

from fw.errors import ConfigError, FwError, InvalidRequestError, UnknownImplementationError
from fw.grammar.bitmask import allocate_token_bitmask
from fw.grammar.constraint import Constraint, StructuredOutputsParams
from fw.grammar.contract import CompiledGrammar, GrammarCompiler, GrammarError, GrammarMatcher, fill_bitmask_batch
from fw.grammar.tokenizer import GrammarTokenizer
from fw.plugins.registry import Registry
from fw.plugins.selection import select_grammar_backend

logger = logging.getLogger("fw.grammar")


class SequenceGrammar:
    """A sequence's matcher and the compiler that made it (for batched mask fills)."""

    __slots__ = ("backend", "compiler", "matcher")

    def __init__(self, backend: str, compiler: GrammarCompiler, matcher: GrammarMatcher):
        self.backend, self.compiler, self.matcher = backend, compiler, matcher


class GrammarService:
    def __init__(self, registry: Registry, tokenizer: GrammarTokenizer, default_backend: str = "auto",
                 max_cached: int = 256, workers: int = 1, enabled: bool = True):
        self.registry = registry
        self.enabled = enabled  # --no-enable-structured-output: every constraint is refused
        self.tokenizer = tokenizer
        self.default_backend = default_backend
        if default_backend not in ("auto", None) and default_backend not in registry:
            known = ", ".join(sorted(s.name for s in registry)) or "none installed"
            raise UnknownImplementationError(
                f"--grammar-backend {default_backend!r} is not an installed grammar backend; installed: {known}")
        self.max_cached = max_cached
        self._compilers: dict[str, GrammarCompiler] = {}
        self._cache: OrderedDict[tuple[str, Constraint], concurrent.futures.Future] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="fw-grammar")
        self._bitmask: torch.Tensor | None = None
        self.compile_seconds = 0.0
        self.num_compiles = 0

    # -- compiling --------------------------------------------------------------------

    def backend_name(self, params: StructuredOutputsParams) -> str:
        """The backend for this request: its own `backend`, else --grammar-backend, else auto."""
        if not self.enabled:
            raise InvalidRequestError(
                "structured output is turned off on this server (--no-enable-structured-output): response_format "
                "json_object/json_schema, guided_*, structured_outputs and tool_choice required or named are "
                "refused; send the request without a constraint, or start fw with --enable-structured-output",
                param="structured_outputs")
        kind = params.constraint().kind
        try:
            return select_grammar_backend(self.registry, kind, params.backend or self.default_backend).chosen.name
        except ConfigError as exc:  # a request's choice, not the server's configuration: a 400 for it
            raise InvalidRequestError(str(exc), param="structured_outputs") from None

    def compile_async(self, params: StructuredOutputsParams) -> concurrent.futures.Future:
        """A future of (backend name, CompiledGrammar). Selection errors raise here; compile errors
        (GrammarError) come out of the future. Equal constraints share one compile."""
        backend = self.backend_name(params)
        key = (backend, params.constraint())
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, backend, key[1])
            self._cache[key] = future
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        # A failed compile is not cached: the next request retries it (and gets its own error).
        future.add_done_callback(lambda f: f.exception() is not None and self._forget(key, f))
        return future

    def compile(self, params: StructuredOutputsParams) -> tuple[str, CompiledGrammar]:
        return self.compile_async(params).result()

    def new_grammar(self, params: StructuredOutputsParams) -> tuple[str, CompiledGrammar, GrammarCompiler]:
        backend, compiled = self.compile(params)
        return backend, compiled, self._compilers[backend]

    def _forget(self, key: tuple, future: concurrent.futures.Future) -> None:
        with self._lock:
            if self._cache.get(key) is future:
                del self._cache[key]

    def _compiler(self, backend: str) -> GrammarCompiler:
        with self._lock:
            compiler = self._compilers.get(backend)
        if compiler is None:
            compiler = self.registry.get(backend).factory(self.tokenizer)
            with self._lock:
                compiler = self._compilers.setdefault(backend, compiler)
        return compiler

    def _compile(self, backend: str, constraint: Constraint) -> tuple[str, CompiledGrammar]:
        start = time.perf_counter()
        try:
            compiled = self._compiler(backend).compile(constraint)
        except FwError:
            raise
        except Exception as exc:  # a backend's own exception type: say which backend and why
            raise GrammarError(backend, f"cannot compile {constraint.describe()}: {exc}") from None
        elapsed = time.perf_counter() - start
        self.compile_seconds += elapsed
        self.num_compiles += 1
        logger.debug("compiled %s with %s in %.3f s", constraint.describe(), backend, elapsed)
        return backend, compiled

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- masking ----------------------------------------------------------------------

    def fill_bitmask(self, grammars: Sequence[SequenceGrammar | None]) -> tuple[torch.Tensor, list[int]] | None:
        """The bitmask rows of the constrained entries of `grammars` (one per sampled row) and their
        row indices, or None when no row is constrained. Rows are grouped by backend so each
        backend fills its rows in one batched call."""
        rows = [i for i, g in enumerate(grammars) if g is not None]
        if not rows:
            return None
        bitmask = self._rows(len(rows))
        groups: dict[str, list[int]] = {}
        for r, i in enumerate(rows):
            groups.setdefault(grammars[i].backend, []).append(r)
        for backend_rows in groups.values():
            compiler = grammars[rows[backend_rows[0]]].compiler
            fill_bitmask_batch(compiler, [grammars[rows[r]].matcher for r in backend_rows], bitmask, backend_rows)
        return bitmask, rows

    def fill_bitmask_with_drafts(self, grammars: Sequence[SequenceGrammar | None],
                                 drafts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, list[int]] | None:
        """As `fill_bitmask` for a step that verifies drafts (speculative decoding): entry i has
        1 + len(drafts[i]) sampled rows, the position after its last token and after each draft token.
        A constrained entry's matcher is advanced through its draft to fill those rows, then rolled
        back. Past a draft token the grammar refuses, the rows repeat the last one: that token's
        probability is 0, so it is rejected and the later rows are never used."""
        widths = [1 + len(d) for d in drafts]
        starts = [0]
        for w in widths:
            starts.append(starts[-1] + w)
        firsts = [None] * starts[-1]
        for i, g in enumerate(grammars):
            firsts[starts[i]] = g
        mask = self.fill_bitmask(firsts)  # every first row, batched per backend
        if mask is None:
            return None
        first_bitmask, first_rows = mask
        rows = [starts[i] + j for i, g in enumerate(grammars) if g is not None for j in range(widths[i])]
        if len(rows) == len(first_rows):
            return mask
        bitmask = torch.full((len(rows), first_bitmask.shape[1]), -1, dtype=first_bitmask.dtype,
                             device=first_bitmask.device)
        at = {row: r for r, row in enumerate(rows)}
        bitmask[[at[row] for row in first_rows]] = first_bitmask
        for i, g in enumerate(grammars):
            if g is None or not drafts[i]:
                continue
            base = at[starts[i]]
            accepted = 0
            for j, token in enumerate(drafts[i], start=1):
                if accepted == j - 1 and g.matcher.accept_token(int(token)):
                    accepted += 1
                    g.matcher.fill_bitmask(bitmask, base + j)
                else:
                    bitmask[base + j] = bitmask[base + j - 1]
            if accepted:
                g.matcher.rollback(accepted)
        return bitmask, rows

    def _rows(self, n: int) -> torch.Tensor:
        """A reused [n, words] buffer reset to all-allowed."""
        buf = self._bitmask
        if buf is None or buf.shape[0] < n:
            buf = self._bitmask = allocate_token_bitmask(max(n, 8), self.tokenizer.vocab_size)
        view = buf[:n]
        view.fill_(-1)
        return view

    def stats(self) -> dict[str, Any]:
        return {"grammar_compiles": self.num_compiles, "grammar_compile_seconds": self.compile_seconds}
