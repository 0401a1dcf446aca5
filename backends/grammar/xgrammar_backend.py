"""The `xgrammar` grammar backend: structured output through xgrammar's
pushdown-automaton matcher (JSON schema, any JSON object, regex, choice, and
EBNF or Lark grammars).

xgrammar does the work: `TokenizerInfo` holds the vocabulary, `GrammarCompiler`
(thread-safe, with its own cache) compiles, `GrammarMatcher` fills a row's
bitmask in C++ from token sets precomputed per grammar state, and
`BatchGrammarMatcher` fills many rows in one call. This module maps fw's
contract onto it and turns what xgrammar cannot do into a `GrammarError` a
user can act on (xgrammar_schema.py does that for JSON schemas).

Choices (docs/choices.md, "The xgrammar grammar backend"):
- JSON is compact: one line, `", "` and `": "` separators, no other
  whitespace (`any_whitespace=False`; vLLM's `disable_any_whitespace`). With
  any whitespace allowed, a uniform walk over the allowed tokens never ends
  (hundreds of whitespace tokens beat the few structural ones), and SmolLM2 at
  temperature 1 drifted into whitespace runs until max_tokens; a bound
  (`max_whitespace_cnt`) costs 25x the fill time (40 vs 1.6 us a row).
- Strict mode: an object takes only the properties its schema lists unless the
  schema allows more (`additionalProperties`), as OpenAI's structured outputs do.
- `json_object` compiles the schema `{"type": "object"}`: xgrammar's built-in
  JSON grammar also admits a top-level array.
- Special tokens other than the stop tokens are blanked in the vocabulary
  xgrammar sees: it would otherwise let `<filename>` (SmolLM2's id 6) spell
  text inside a JSON string."""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from importlib.metadata import version
from typing import Any, Sequence

import torch

from fw.backends.grammar.xgrammar_schema import error_reason, prepare_schema
from fw.grammar import Constraint, GrammarError, GrammarTokenizer, KeptGrammars
from fw.plugins import GrammarBackendSpec, hookimpl

FW_PLUGIN_API_VERSION = "1.8"  # fw.grammar.KeptGrammars
NAME = "xgrammar"
ANY_WHITESPACE = False
# xgrammar's own cache of compiled grammars, bounded (fw's GrammarService keeps an LRU of the hot ones).
CACHE_LIMIT_BYTES = 256 * 1024 * 1024
_GRAMMAR_HINT = "xgrammar takes EBNF with a `root` rule (root ::= ...) or Lark with a `start` rule"
logger = logging.getLogger(__name__)


@functools.cache
def _unavailable() -> str | None:
    try:
        import xgrammar  # noqa: F401
    except Exception as exc:  # ImportError, or a native library that does not load
        return f"xgrammar cannot be imported ({exc}); install it: pip install xgrammar"
    return None


class XGrammarMatcher:
    """One sequence's position in a compiled grammar (used only from the engine thread)."""

    __slots__ = ("_matcher", "_stop_row")

    def __init__(self, matcher: Any, stop_row: torch.Tensor):
        self._matcher = matcher
        self._stop_row = stop_row

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._matcher.is_terminated():  # xgrammar raises here; only a stop token can follow the end
            bitmask[row].copy_(self._stop_row)
            return
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        return self._matcher.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens < 0:
            raise ValueError(f"rollback takes a token count >= 0, got {num_tokens}")
        if num_tokens:
            try:
                self._matcher.rollback(num_tokens)
            except RuntimeError as exc:
                raise ValueError(f"cannot roll back {num_tokens} tokens: {error_reason(exc)}") from None

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()


class XGrammarCompiled:
    """A compiled grammar, shared by every request with the same constraint."""

    __slots__ = ("compiled", "_stop_row")

    def __init__(self, compiled: Any, stop_row: torch.Tensor):
        self.compiled = compiled
        self._stop_row = stop_row

    def matcher(self) -> XGrammarMatcher:
        import xgrammar as xgr  # here: xgrammar costs start-up time; only a request that uses it pays
        return XGrammarMatcher(xgr.GrammarMatcher(self.compiled), self._stop_row)


class XGrammarCompiler:
    """What the `xgrammar` factory returns: one per engine; `compile` is safe from any thread."""

    def __init__(self, tokenizer: GrammarTokenizer):
        import xgrammar as xgr  # here: xgrammar costs start-up time; only a request that uses it pays
        self._xgr = xgr
        self.tokenizer = tokenizer
        self.info = tokenizer_info(tokenizer)
        threads = max(1, min(8, os.cpu_count() or 1))
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_limit_bytes=CACHE_LIMIT_BYTES)
        self._stop_row = _stop_only_row(tokenizer)
        self._batch: Any = None  # a BatchGrammarMatcher, made on the first batched fill (engine thread)
        self._kept = KeptGrammars(NAME, lambda: f"xgrammar {version('xgrammar')}; any_whitespace={ANY_WHITESPACE}; "
                                                "strict", tokenizer)

    def compile(self, constraint: Constraint) -> XGrammarCompiled:
        try:
            compiled = self._kept.load(constraint, lambda data: self._xgr.CompiledGrammar.deserialize_json(
                data.decode(), self.info))
            if compiled is None:
                compiled = self._compile(constraint)
        except (RuntimeError, ValueError) as exc:
            hint = f" ({_GRAMMAR_HINT})" if constraint.kind == "grammar" else ""
            raise GrammarError(NAME, f"cannot compile {constraint.describe()}{hint}: {error_reason(exc)}") from None
        return XGrammarCompiled(compiled, self._stop_row)

    # -- kept across processes (`fw warm-cache --warm-schemas`; docs/warm-cache.md) --------------

    def persisted(self, constraint: Constraint) -> bool:
        return self._kept.has(constraint)

    def persist(self, constraint: Constraint) -> str:
        """Compile `constraint` (GrammarError if it cannot be) and keep its serialized form, but only where
        loading it beats compiling it: a large grammar serializes to megabytes that take longer to read
        (0.62 s) than to rebuild (0.06 s). An empty entry then records "checked; compile it"."""
        start = time.perf_counter()
        compiled = self.compile(constraint).compiled
        compile_s = time.perf_counter() - start
        data = compiled.serialize_json()
        start = time.perf_counter()
        self._xgr.CompiledGrammar.deserialize_json(data, self.info)
        load_s = time.perf_counter() - start
        keep = load_s < compile_s
        self._kept.save(constraint, data.encode() if keep else b"")
        return (f"compiled in {compile_s * 1000:.0f} ms, kept ({self._kept.size_text(len(data))}, loads in "
                f"{load_s * 1000:.0f} ms)" if keep else
                f"compiled in {compile_s * 1000:.0f} ms; not kept: loading takes {load_s * 1000:.0f} ms")

    def _compile(self, constraint: Constraint) -> Any:
        compiler, kind = self._compiler, constraint.kind
        if kind == "json_schema":
            schema = json.dumps(prepare_schema(constraint.schema))  # a bare true/false must be text
            return compiler.compile_json_schema(schema, any_whitespace=ANY_WHITESPACE, strict_mode=True)
        if kind == "json_object":
            return compiler.compile_json_schema({"type": "object"}, any_whitespace=ANY_WHITESPACE, strict_mode=False)
        if kind == "regex":
            return self._compile_regex(constraint.value)
        if kind == "choice":
            return compiler.compile_grammar(choice_ebnf(constraint.value))
        if kind == "grammar":
            if "::=" in constraint.value:  # GBNF-style EBNF; Lark writes rules as `name: ...`
                return compiler.compile_grammar(constraint.value, root_rule_name="root")
            return compiler.compile_lark(constraint.value)
        raise GrammarError(NAME, f"{kind} constraints are not supported (json_schema, json_object, regex, "
                                 "choice and grammar are)")

    def _compile_regex(self, pattern: str) -> Any:
        """As one finite automaton (`root ::= Regex(...)`): xgrammar then precomputes every state's
        token set, where `compile_regex` makes grammar rules whose counted repetitions it re-checks
        against the vocabulary each step (25 ms vs 0.02 ms a fill for `(\\w+ ){1,20}\\w+\\.`)."""
        self._xgr.Grammar.from_regex(pattern)  # raises for what xgrammar's regex parser lacks (lookarounds)
        pattern = python_dot(pattern)
        try:
            return self._compiler.compile_grammar("root ::= Regex(%s)" % _ebnf_literal(pattern))
        except RuntimeError:  # more than 128 counted repetitions trip the automaton builder
            return self._compiler.compile_regex(pattern)

    def fill_bitmask_batch(self, matchers: Sequence[XGrammarMatcher], bitmask: torch.Tensor,
                           rows: Sequence[int]) -> None:
        """All rows in one C++ call, spread over xgrammar's threads (half the cores)."""
        if self._batch is None:
            self._batch = self._xgr.BatchGrammarMatcher("auto")
        try:
            self._batch.batch_fill_next_token_bitmask([m._matcher for m in matchers], bitmask, list(rows))
        except RuntimeError:  # a terminated matcher among them: row by row, which handles it
            for matcher, row in zip(matchers, rows):
                matcher.fill_bitmask(bitmask, row)


def tokenizer_info(tokenizer: GrammarTokenizer) -> Any:
    """xgrammar's view of the vocabulary, `vocab_size` (the logits width) wide: the vocabulary type
    xgrammar detects, with the non-stop special tokens blanked (xgrammar never allows an empty
    token) and the ids past the tokenizer's vocabulary empty."""
    import xgrammar as xgr  # here: xgrammar costs start-up time; only a request that uses it pays
    hf = tokenizer.hf_tokenizer
    stop = sorted(tokenizer.eos_token_ids)
    real = getattr(hf, "transformers_tokenizer", None)  # fw's FastTokenizer: xgrammar inspects transformers' own
    detected = xgr.TokenizerInfo.from_huggingface(real() if callable(real) else hf, vocab_size=tokenizer.vocab_size,
                                                  stop_token_ids=stop)
    special = tokenizer.special_token_ids
    encoded = [""] * tokenizer.vocab_size
    for piece, token_id in hf.get_vocab().items():
        if 0 <= token_id < tokenizer.vocab_size and token_id not in special:
            encoded[token_id] = piece
    return xgr.TokenizerInfo(encoded, detected.vocab_type, vocab_size=tokenizer.vocab_size,
                             stop_token_ids=stop, add_prefix_space=detected.add_prefix_space)


def python_dot(pattern: str) -> str:
    """`.` as Python's `re` reads it: any character but a newline (xgrammar's `.` takes one too).
    Escaped dots and dots inside a character class are literal and stay."""
    out: list[str] = []
    i, class_body = 0, -1  # class_body: where the open class's members start (-1: not in a class)
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if class_body >= 0:
            if ch == "]" and i > class_body:  # a "]" first in the class is a member
                class_body = -1
        elif ch == "[":
            class_body = i + 2 if pattern.startswith("^", i + 1) else i + 1
        elif ch == ".":
            ch = "[^\\n]"
        out.append(ch)
        i += 1
    return "".join(out)


def _stop_only_row(tokenizer: GrammarTokenizer) -> torch.Tensor:
    """A bitmask row that allows only the stop tokens (all that may follow a terminated matcher)."""
    words = [0] * ((tokenizer.vocab_size + 31) // 32)
    for token_id in tokenizer.eos_token_ids:
        words[token_id // 32] |= 1 << (token_id % 32)
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


def choice_ebnf(options: Sequence[str]) -> str:
    """`root ::= "a" | "b"`: exactly one of the options, each escaped as an EBNF string literal."""
    for option in options:
        try:
            option.encode("utf-8")
        except UnicodeEncodeError:
            raise GrammarError(NAME, f"choice {option!r} is not valid Unicode text (a lone surrogate?)") from None
    return "root ::= " + " | ".join(_ebnf_literal(option) for option in options)


def _ebnf_literal(text: str) -> str:
    """Printable ASCII as is (quote and backslash escaped); everything else as a \\u / \\U escape."""
    out = []
    for ch in text:
        code = ord(ch)
        if ch in '"\\':
            out.append("\\" + ch)
        elif 0x20 <= code < 0x7F:
            out.append(ch)
        elif code <= 0xFFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    return '"' + "".join(out) + '"'


@hookimpl
def fw_register_grammar_backends(register) -> None:
    register(GrammarBackendSpec(
        name=NAME,
        factory=XGrammarCompiler,
        constraint_kinds=("json_schema", "json_object", "regex", "choice", "grammar"),
        priority=20,
        available=_unavailable,
        description="xgrammar: JSON schema, JSON object, regex, choice, EBNF/Lark grammars; "
                    "masks filled in C++ from token sets precomputed per grammar state",
    ))


@hookimpl
def fw_warm_cache_artifacts(context, add) -> None:
    """Precompile the --warm-schemas entries the server would send to xgrammar."""
    if context.options.get("warm_schemas"):
        # here: fw warm-cache's hook; serving never loads the warm-cache tooling
        from fw.warm import GrammarWarmArtifact

        add(GrammarWarmArtifact(NAME, owner=NAME))
