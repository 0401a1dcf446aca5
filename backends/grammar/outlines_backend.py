"""The `outlines` grammar backend: structured output through outlines-core's
token-level automaton (JSON schema, any JSON object, regex, choice).

outlines-core turns a regular expression into an `Index`: for every state of
the regex's automaton, the tokens that may come next and where each leads. It
is built once per constraint (in Rust, with the GIL released, so a slow build
does not stall the engine thread) and shared; each sequence walks it with its
own `Guide`. Everything becomes a regex first: JSON schemas through
outlines-core's `build_regex_from_schema` (with the fixes in outlines_schema),
a choice as an escaped alternation.

Choices (see docs/choices.md, "The outlines grammar backend"):
- JSON whitespace is outlines-core's default `[ ]?`: at most one space where
  JSON allows whitespace, so a model cannot pad output with endless blanks.
- `json_object` compiles outlines-core's regex for `{"type": "object"}`:
  containers nested at most three deep, the object itself included (a regex
  cannot count brackets); slow to compile (seconds), then cached.
- Numbers carry at most 16 integer, 10 fraction and 3 exponent digits where
  the schema sets no bound: a sampled model otherwise writes digits forever.
- Stop tokens: outlines-core knows one EOS id (`GrammarTokenizer.eos_token_id`);
  every other stop token is treated the same (allowed exactly where the
  automaton is in a final state).
- Masks: `Guide.write_mask_into` writes a state's packed row straight into the
  int32 bitmask (slow for a state that allows most of the vocabulary, fast for
  a few tokens: docs/performance.md); rows that were slow to build are kept per
  (grammar, state), bounded in bytes, and copied on the next visit."""

from __future__ import annotations

import ctypes
import functools
import itertools
import logging
import threading
import time
from importlib.metadata import version
from typing import Any, Sequence

import torch

from fw.backends.grammar.outlines_regex import choice_regex
from fw.backends.grammar.outlines_schema import SchemaError, schema_to_regex
from fw.grammar import Constraint, GrammarError, GrammarTokenizer, KeptGrammars
from fw.plugins import GrammarBackendSpec, hookimpl

FW_PLUGIN_API_VERSION = "1.8"  # fw.grammar.KeptGrammars
NAME = "outlines"

# outlines-core's default: at most one space between JSON tokens.
WHITESPACE_PATTERN: str | None = None
# Tokens a matcher can roll back (outlines-core keeps this many past states per sequence).
MAX_ROLLBACK = 64
# Packed mask rows kept for reuse, per compiler (a row is vocab_size / 8 bytes: 6 KiB for 49k).
MASK_CACHE_BYTES = 64 * 1024 * 1024
# A row is kept when building it took longer than this (copying a kept row is cheaper: docs/performance.md).
KEEP_ROWS_SLOWER_THAN_S = 10e-6

_serials = itertools.count()
logger = logging.getLogger(__name__)


@functools.cache
def _unavailable() -> str | None:
    try:
        import outlines_core  # noqa: F401
    except Exception as exc:  # ImportError, or a broken native library
        return f"outlines-core cannot be imported ({exc}); install it: pip install outlines-core"
    return None


class _Rows:
    """Writes mask rows into a CPU int32 bitmask by address, and keeps the rows that were slow to
    build (states that allow much of the vocabulary) keyed by (grammar, state): a state's row
    never changes, and copying 6 KiB is much cheaper than building it. Rows that
    are quick to build (a few allowed tokens) are not kept: a copy would cost as much. Used only
    from the engine thread."""

    def __init__(self, tokenizer: GrammarTokenizer, budget_bytes: int):
        words: dict[int, int] = {}
        for token_id in tokenizer.eos_token_ids:
            if 0 <= token_id < tokenizer.vocab_size:
                words[token_id // 32] = words.get(token_id // 32, 0) | (1 << (token_id % 32))
        # (word offset in bytes, the word's stop bits as a signed int32)
        self.stop_bits = [(4 * w, b - (1 << 32) if b >= 1 << 31 else b) for w, b in words.items()]
        self.budget = budget_bytes
        self.cache: dict[tuple[int, int], bytes] = {}  # insertion order: the oldest is evicted first
        self.cached_bytes = 0
        self.row_bytes = 0

    def add_stops(self, ptr: int) -> None:
        for offset, bits in self.stop_bits:
            word = ctypes.c_int32.from_address(ptr + offset)
            word.value |= bits

    def write(self, serial: int, guide: Any, terminated: bool, ptr: int, words: int) -> None:
        nbytes = 4 * words
        if terminated:  # only a stop token may follow
            ctypes.memset(ptr, 0, nbytes)
            self.add_stops(ptr)
            return
        if nbytes != self.row_bytes:  # another row width: the kept rows do not fit
            self.cache.clear()
            self.cached_bytes, self.row_bytes = 0, nbytes
        key = (serial, guide.get_state())
        row = self.cache.get(key)
        if row is not None:
            ctypes.memmove(ptr, row, nbytes)
            return
        start = time.perf_counter()
        guide.write_mask_into(ptr, words, 4)  # clears the whole row, then sets the allowed tokens
        if guide.is_finished():
            self.add_stops(ptr)
        if time.perf_counter() - start > KEEP_ROWS_SLOWER_THAN_S and nbytes <= self.budget:
            self.cache[key] = ctypes.string_at(ptr, nbytes)
            self.cached_bytes += nbytes
            while self.cached_bytes > self.budget:
                self.cached_bytes -= len(self.cache.pop(next(iter(self.cache))))


class OutlinesMatcher:
    """One sequence's position in a compiled grammar (used only from the engine thread)."""

    __slots__ = ("_grammar", "_guide", "_terminated")

    def __init__(self, grammar: "OutlinesGrammar"):
        from outlines_core import Guide  # here: outlines_core costs start-up time; only a request that uses it pays
        self._grammar = grammar
        self._guide = Guide(grammar.index, max_rollback=MAX_ROLLBACK)
        self._terminated = False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        grammar = self._grammar
        _check_rows(bitmask, (row,))
        words = bitmask.shape[1]
        if bitmask.device.type == "cpu" and (bitmask.stride(1) == 1 or words == 1):
            ptr = bitmask.data_ptr() + 4 * row * bitmask.stride(0)
            grammar.rows.write(grammar.serial, self._guide, self._terminated, ptr, words)
            return
        scratch = torch.empty(words, dtype=torch.int32)  # an accelerator's bitmask: build on the CPU, copy
        grammar.rows.write(grammar.serial, self._guide, self._terminated, scratch.data_ptr(), words)
        bitmask[row].copy_(scratch)

    def accept_token(self, token_id: int) -> bool:
        if self._terminated:
            return False
        guide = self._guide
        if token_id in self._grammar.stop_ids:
            if not guide.is_finished():
                return False
            self._terminated = True
            return True
        if self._grammar.index.get_next_state(guide.get_state(), token_id) is None:
            return False
        guide.advance(token_id, return_tokens=False)
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens < 0:
            raise ValueError(f"rollback takes a token count >= 0, got {num_tokens}")
        if num_tokens and self._terminated:  # the stop token was the last one accepted
            self._terminated = False
            num_tokens -= 1
        if num_tokens:
            available = self._guide.get_allowed_rollback()
            if num_tokens > available:
                raise ValueError(f"cannot roll back {num_tokens} tokens: only the last {available} are kept "
                                 f"(the outlines backend keeps at most {MAX_ROLLBACK})")
            self._guide.rollback_state(num_tokens)

    def is_terminated(self) -> bool:
        return self._terminated


class OutlinesGrammar:
    """A compiled constraint: outlines-core's Index, shared by every request with the same
    constraint (an Index is immutable; each matcher walks it with its own Guide)."""

    __slots__ = ("index", "regex", "serial", "rows", "stop_ids")

    def __init__(self, index: Any, regex: str, rows: _Rows, stop_ids: frozenset[int]):
        self.index = index
        self.regex = regex
        self.serial = next(_serials)  # keys this grammar's rows in the mask cache
        self.rows = rows
        self.stop_ids = stop_ids

    def matcher(self) -> OutlinesMatcher:
        return OutlinesMatcher(self)


def _index_from_binary(data: bytes) -> Any:
    from outlines_core import Index  # here: outlines_core costs start-up time

    return Index.from_binary(data)


class OutlinesCompiler:
    """Compiles constraints to outlines-core Indexes over the engine's vocabulary. `compile` is
    thread-safe; the Vocabulary is built once (about 0.2 s for 49k tokens) on first use."""

    def __init__(self, tokenizer: GrammarTokenizer):
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        self._vocabulary: Any = None
        self._rows = _Rows(tokenizer, MASK_CACHE_BYTES)
        self._kept = KeptGrammars(NAME, lambda: f"outlines-core {version('outlines_core')}; "
                                                f"whitespace={WHITESPACE_PATTERN!r}", tokenizer)

    def vocabulary(self) -> Any:
        """outlines-core's Vocabulary: each token's bytes -> its ids; stop and special tokens left out
        (outlines-core adds its single EOS id itself)."""
        with self._lock:
            if self._vocabulary is None:
                from outlines_core import Vocabulary  # here: outlines_core costs start-up time
                tok = self.tokenizer
                if not tok.eos_token_ids:
                    raise GrammarError(NAME, "the model has no stop token, so a constrained output could never end")
                stops = tok.eos_token_ids
                by_bytes: dict[bytes, list[int]] = {}
                for token_id, piece in enumerate(tok.token_bytes()):
                    if piece and token_id not in stops:
                        by_bytes.setdefault(piece, []).append(token_id)
                self._vocabulary = Vocabulary(tok.eos_token_id, by_bytes)
            return self._vocabulary

    def compile(self, constraint: Constraint) -> OutlinesGrammar:
        regex = self.regex_for(constraint)
        from outlines_core import Index  # here: outlines_core costs start-up time
        try:
            index = self._kept.load(constraint, _index_from_binary)
            if index is None:
                index = Index(regex, self.vocabulary())
        except ValueError as exc:
            reason = " ".join(str(exc).split())
            hint = (" (outlines-core compiles Rust regex syntax without look-around, back-references or anchors "
                    "inside the pattern)" if constraint.kind == "regex" else "")
            raise GrammarError(NAME, f"cannot compile {constraint.describe()}: {reason}{hint}") from None
        return OutlinesGrammar(index, regex, self._rows, self.tokenizer.eos_token_ids)

    # -- kept across processes (`fw warm-cache --warm-schemas`; docs/warm-cache.md) --------------

    def persisted(self, constraint: Constraint) -> bool:
        return self._kept.has(constraint)

    def persist(self, constraint: Constraint) -> str:
        """Compile `constraint` (GrammarError if it cannot be) and keep its Index: reading one back is
        much faster than building it (docs/performance.md)."""
        start = time.perf_counter()
        index = self.compile(constraint).index
        data = index.__reduce__()[1][0]  # the Index's own binary form (what pickling it stores)
        self._kept.save(constraint, data)
        seconds = time.perf_counter() - start
        return f"compiled in {seconds * 1000:.0f} ms, kept ({self._kept.size_text(len(data))})"

    def regex_for(self, constraint: Constraint) -> str:
        """The regex a constraint compiles to (GrammarError for what this backend cannot express)."""
        kind = constraint.kind
        try:
            if kind == "json_schema":
                return schema_to_regex(constraint.schema, WHITESPACE_PATTERN)
            if kind == "json_object":
                return schema_to_regex({"type": "object"}, WHITESPACE_PATTERN)
        except SchemaError as exc:
            raise GrammarError(NAME, f"cannot compile the JSON schema: {exc}") from None
        if kind == "regex":
            return _strip_anchors(constraint.value)
        if kind == "choice":
            for option in constraint.value:
                try:
                    option.encode("utf-8")
                except UnicodeEncodeError:
                    raise GrammarError(NAME, f"choice {option!r} is not valid Unicode text (a lone surrogate?)") \
                        from None
            return choice_regex(constraint.value)
        raise GrammarError(NAME, f"{kind} constraints are not supported (json_schema, json_object, regex and choice "
                                 "are); use the xgrammar backend for grammars")

    def fill_bitmask_batch(self, matchers: Sequence[OutlinesMatcher], bitmask: torch.Tensor,
                           rows: Sequence[int]) -> None:
        """Row by row, with the address arithmetic and checks done once for the batch."""
        _check_rows(bitmask, rows)
        if bitmask.device.type != "cpu" or (bitmask.stride(1) != 1 and bitmask.shape[1] != 1):
            for matcher, row in zip(matchers, rows):
                matcher.fill_bitmask(bitmask, row)
            return
        base, row_bytes, words = bitmask.data_ptr(), 4 * bitmask.stride(0), bitmask.shape[1]
        write = self._rows.write
        for matcher, row in zip(matchers, rows):
            write(matcher._grammar.serial, matcher._guide, matcher._terminated, base + row * row_bytes, words)


def _check_rows(bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Rows are written by address: refuse anything that would write outside the tensor."""
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2:
        raise ValueError(f"the token bitmask must be a 2-D int32 tensor, got {bitmask.dtype} {tuple(bitmask.shape)}")
    if rows and not (0 <= min(rows) and max(rows) < bitmask.shape[0]):
        raise IndexError(f"bitmask rows {list(rows)} out of range for {bitmask.shape[0]} rows")


def _strip_anchors(pattern: str) -> str:
    """The whole output must match anyway; outlines-core refuses a leading '^' or trailing '$'."""
    if pattern.startswith("^"):
        pattern = pattern[1:]
    if pattern.endswith("$") and (len(pattern) - len(pattern[:-1].rstrip("\\")) - 1) % 2 == 0:
        pattern = pattern[:-1]
    return pattern


@hookimpl
def fw_register_grammar_backends(register) -> None:
    register(GrammarBackendSpec(
        name=NAME,
        factory=OutlinesCompiler,
        constraint_kinds=("json_schema", "json_object", "regex", "choice"),
        priority=10,
        available=_unavailable,
        description="outlines-core: JSON schema, JSON object, regex and choice through a token-level "
                    "automaton index built per constraint",
    ))


@hookimpl
def fw_warm_cache_artifacts(context, add) -> None:
    """Precompile the --warm-schemas entries the server would send to outlines."""
    if context.options.get("warm_schemas"):
        # here: fw warm-cache's hook; serving never loads the warm-cache tooling
        from fw.warm import GrammarWarmArtifact

        add(GrammarWarmArtifact(NAME, owner=NAME))
