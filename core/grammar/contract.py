"""The grammar-backend contract: what a `GrammarBackendSpec.factory` returns.

`factory(tokenizer: GrammarTokenizer)` -> a `GrammarCompiler`, made once per
engine and backend. The compiler turns a `Constraint` into a `CompiledGrammar`
(immutable, cached and shared by every request with the same constraint); each
sequence gets its own `GrammarMatcher` from it. Compiles run on a worker
thread, so a compiler must be safe to call from a thread other than the one
that steps the engine (matchers are only used from the engine thread).

Masks are packed bitmasks, the layout xgrammar, outlines-core and vLLM share:
an int32 tensor [rows, ceil(vocab_size / 32)] in which bit j of word w allows
token 32 * w + j. A row starts all ones; a matcher clears what it forbids or
writes the whole row."""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import torch

from fw.errors import InvalidRequestError
from fw.grammar.constraint import Constraint


class GrammarError(InvalidRequestError):
    """A constraint the backend cannot compile (bad schema, regex it cannot handle, a feature it
    lacks). The message names the backend and the reason; the server answers 400."""

    def __init__(self, backend: str, reason: str, param: str | None = "response_format"):
        super().__init__(f"grammar backend {backend!r}: {reason}", param=param)
        self.backend = backend
        self.reason = reason


@runtime_checkable
class GrammarMatcher(Protocol):
    """One sequence's position in a grammar."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]` (see the module docstring)."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (and no change) if the grammar does not allow it."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (for speculative decoding)."""

    def is_terminated(self) -> bool:
        """True once the grammar has accepted its end (EOS): nothing more may follow."""


@runtime_checkable
class CompiledGrammar(Protocol):
    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the grammar's start."""


@runtime_checkable
class GrammarCompiler(Protocol):
    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """Compile or raise `GrammarError` saying why not."""


def fill_bitmask_batch(compiler: object, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor,
                       rows: Sequence[int]) -> None:
    """Fill several rows: through the compiler's own batched `fill_bitmask_batch` when it has one
    (xgrammar fills a batch in parallel), else matcher by matcher."""
    batched = getattr(compiler, "fill_bitmask_batch", None)
    if batched is not None:
        batched(matchers, bitmask, rows)
        return
    for matcher, row in zip(matchers, rows):
        matcher.fill_bitmask(bitmask, row)
