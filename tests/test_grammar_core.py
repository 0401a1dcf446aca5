"""The grammar contract's core side, with a small real backend written here
(choice constraints by prefix matching over each token's bytes): masks reach
only their rows, compiles are cached and run off the caller's thread, failures
are not cached and name the backend, and a row that min_tokens would leave
with no allowed token still samples."""

from __future__ import annotations

import threading

import pytest
import torch

from fw import SamplingParams
from fw.errors import InvalidRequestError, UnknownImplementationError
from fw.grammar import (Constraint, GrammarError, GrammarTokenizer, StructuredOutputsParams, allocate_token_bitmask,
                        apply_token_bitmask, bitmask_to_bool)
from fw.grammar.service import GrammarService
from fw.plugins.registry import Registry
from fw.plugins.specs import GrammarBackendSpec


class PrefixChoiceMatcher:
    def __init__(self, compiled: "PrefixChoices"):
        self.c = compiled
        self.text = b""
        self.history: list[bytes] = []
        self.terminated = False

    def _allows(self, token: int) -> bool:
        if token in self.c.stops:
            return not self.terminated and self.text in self.c.choices
        piece = self.c.pieces[token] if token < len(self.c.pieces) else None
        return (not self.terminated and piece is not None and piece != b""
                and any(ch.startswith(self.text + piece) for ch in self.c.choices))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        allowed = torch.tensor([self._allows(t) for t in range(self.c.vocab_size)])
        padded = torch.zeros(bitmask.shape[1] * 32, dtype=torch.bool)
        padded[:allowed.numel()] = allowed
        words = (padded.view(-1, 32).to(torch.int64) << torch.arange(32)).sum(1)
        bitmask[row] = ((words + 2**31) % 2**32 - 2**31).to(torch.int32)

    def accept_token(self, token: int) -> bool:
        if not self._allows(token):
            return False
        piece = b"" if token in self.c.stops else self.c.pieces[token]
        self.history.append(piece)
        self.text += piece
        self.terminated = token in self.c.stops
        return True

    def rollback(self, num_tokens: int) -> None:
        for _ in range(num_tokens):
            self.text = self.text[:len(self.text) - len(self.history.pop())]
        self.terminated = False

    def is_terminated(self) -> bool:
        return self.terminated


class PrefixChoices:
    def __init__(self, choices: tuple[str, ...], tok: GrammarTokenizer):
        self.choices = [c.encode() for c in choices]
        self.pieces = tok.token_bytes()
        self.stops = tok.eos_token_ids
        self.vocab_size = tok.vocab_size

    def matcher(self) -> PrefixChoiceMatcher:
        return PrefixChoiceMatcher(self)


class PrefixChoiceCompiler:
    def __init__(self, tok: GrammarTokenizer):
        self.tok = tok
        self.compiled_on: list[str] = []

    def compile(self, constraint: Constraint) -> PrefixChoices:
        self.compiled_on.append(threading.current_thread().name)
        if any(c.startswith("!") for c in constraint.value):
            raise ValueError("options may not start with '!'")
        return PrefixChoices(constraint.value, self.tok)


def service_for(engine, default: str = "auto") -> tuple[GrammarService, list[PrefixChoiceCompiler]]:
    made: list[PrefixChoiceCompiler] = []

    def factory(tok):
        made.append(PrefixChoiceCompiler(tok))
        return made[-1]

    registry = Registry("grammar_backend")
    registry.add(GrammarBackendSpec("prefix", factory, constraint_kinds=("choice",)), "test", "tests")
    return GrammarService(registry, engine.grammar.tokenizer, default), made


@pytest.fixture()
def engine_llm(fresh_llm):
    llm = fresh_llm()
    llm.engine.grammar, made = service_for(llm.engine)
    llm.made = made
    return llm


CHOICES = ["hello world", "the lazy dog", "one two"]


def choice(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(choice=CHOICES, **kw)


def test_bitmask_round_trip_and_apply_only_touches_listed_rows() -> None:
    g = torch.Generator().manual_seed(0)
    allowed = torch.rand(3, 70, generator=g) > 0.5
    bitmask = allocate_token_bitmask(3, 70)
    assert bitmask_to_bool(bitmask, 70).all()
    words = torch.zeros(3, 96, dtype=torch.int64)
    words[:, :70] = allowed.to(torch.int64)
    packed = (words.view(3, 3, 32) << torch.arange(32)).sum(-1)
    bitmask.copy_(((packed + 2**31) % 2**32 - 2**31).to(torch.int32))
    assert torch.equal(bitmask_to_bool(bitmask, 70), allowed)
    logits = torch.randn(5, 70)
    before = logits.clone()
    apply_token_bitmask(logits, bitmask, torch.tensor([4, 0, 2]))
    for row, mask_row in ((4, 0), (0, 1), (2, 2)):
        assert torch.equal(torch.isneginf(logits[row]), ~allowed[mask_row])
        assert torch.equal(logits[row][allowed[mask_row]], before[row][allowed[mask_row]])
    assert torch.equal(logits[[1, 3]], before[[1, 3]])


def test_sampled_outputs_are_choices_and_neighbours_are_untouched(engine_llm) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = engine_llm.generate(["hello", "one two three"], greedy)
    mixed = engine_llm.generate(
        ["hello", "the quick", "one two three"],
        [greedy, SamplingParams(n=12, temperature=1.0, seed=1, max_tokens=20, structured_outputs=choice()), greedy])
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == [o.outputs[0].token_ids for o in alone]
    texts = [c.text for c in mixed[1].outputs]
    assert set(texts) <= set(CHOICES) and all(c.finish_reason == "stop" for c in mixed[1].outputs)


def test_compiles_are_cached_off_thread_and_failures_name_the_backend(engine_llm) -> None:
    service = engine_llm.engine.grammar
    params = SamplingParams(temperature=0, max_tokens=20, structured_outputs=choice())
    engine_llm.generate(["a", "b"], params)
    engine_llm.generate(["c"], SamplingParams(temperature=0, max_tokens=20, structured_outputs=choice()))
    (compiler,) = engine_llm.made
    assert len(compiler.compiled_on) == 1 and compiler.compiled_on[0].startswith("fw-grammar")
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["!x"]))
    for _ in range(2):  # a failed compile is retried, not served from the cache
        with pytest.raises(GrammarError, match="'prefix'.*may not start"):
            engine_llm.generate("a", bad)
    assert len(compiler.compiled_on) == 3
    assert service.compile_async(choice()).done()
    assert not engine_llm.engine.has_unfinished_requests()


def test_unsupported_kind_and_unknown_backend_are_request_errors(engine_llm) -> None:
    with pytest.raises(InvalidRequestError, match="'prefix'.*regex constraints not supported"):
        engine_llm.generate("a", SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+",
                                                                                           backend="prefix")))
    with pytest.raises(InvalidRequestError, match="'nosuch'"):
        engine_llm.generate("a", SamplingParams(structured_outputs=choice(backend="nosuch")))
    with pytest.raises(UnknownImplementationError, match="--grammar-backend 'nosuch'"):
        service_for(engine_llm.engine, default="nosuch")


def test_min_tokens_beyond_the_grammar_end_still_samples(engine_llm) -> None:
    """After a full choice the grammar allows only stop tokens, which min_tokens forbids: the row
    falls back to the grammar's mask instead of sampling from nothing (which would fail the step)."""
    out = engine_llm.generate("x", SamplingParams(n=4, temperature=1.0, seed=2, max_tokens=30, min_tokens=25,
                                                  structured_outputs=choice()))[0]
    assert all(c.text in CHOICES for c in out.outputs)


def test_structured_outputs_params_validation() -> None:
    p = SamplingParams(structured_outputs={"json": '{"type": "object", "b": 1, "a": 2}'})
    q = SamplingParams(structured_outputs={"json": {"type": "object", "b": 1, "a": 2}})
    assert p.structured_outputs.constraint() == q.structured_outputs.constraint()
    # declared order is kept: backends emit properties in it
    assert list(p.structured_outputs.constraint().schema) == ["type", "b", "a"]
    for bad, needle in (({"json": "{"}, "not valid JSON"), ({"choice": []}, "non-empty list"),
                        ({}, "got none"), ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
                        ({"jsn": {}}, "jsn")):
        with pytest.raises(InvalidRequestError, match=needle):
            SamplingParams(structured_outputs=bad)


def test_kept_grammars_compile_instead_of_failing_on_an_unreadable_entry(tmp_path, monkeypatch, caplog):
    """What fw warm-cache kept is only a shortcut: an entry another library build wrote, or a damaged
    file, is logged and compiled afresh; nothing kept (or nothing ever warmed) is a plain miss."""
    from types import SimpleNamespace

    from fw.grammar import Constraint
    from fw.warm.grammar import KeptGrammars

    monkeypatch.setenv("FW_CACHE_DIR", str(tmp_path))
    versions = []
    kept = KeptGrammars("demo", lambda: versions.append(1) or "demo 1.0", SimpleNamespace(cache_key="vocab"))
    constraint = Constraint("regex", "[a-z]+")
    assert kept.load(constraint, bytes.decode) is None and versions == []  # never warmed: no store opened
    kept.save(constraint, b"compiled form")
    assert kept.has(constraint) and kept.load(constraint, bytes.decode) == "compiled form"
    assert versions == [1]  # the version label is asked for once

    def unreadable(data: bytes) -> str:
        raise ValueError("written by another build")

    with caplog.at_level("WARNING", logger="fw.warm"):
        assert kept.load(constraint, unreadable) is None
    assert "demo: ignoring the kept compiled form of" in caplog.text and "another build" in caplog.text
