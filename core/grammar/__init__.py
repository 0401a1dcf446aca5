"""Structured output: the grammar-backend contract, the constraint a request
carries, the compiled grammars kept on disk, and the service that compiles
constraints and masks logits."""

from fw.grammar.constraint import CONSTRAINT_KINDS, Constraint, StructuredOutputsParams
from fw.grammar.contract import CompiledGrammar, GrammarCompiler, GrammarError, GrammarMatcher
from fw.grammar.bitmask import allocate_token_bitmask, apply_token_bitmask, bitmask_to_bool
from fw.grammar.kept import GrammarStore, KeptGrammars
from fw.grammar.tokenizer import GrammarTokenizer

__all__ = [
    "CONSTRAINT_KINDS",
    "Constraint",
    "StructuredOutputsParams",
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarError",
    "GrammarMatcher",
    "allocate_token_bitmask",
    "apply_token_bitmask",
    "bitmask_to_bool",
    "GrammarTokenizer",
    "GrammarStore",
    "KeptGrammars",
]
