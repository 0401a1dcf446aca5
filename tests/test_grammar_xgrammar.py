"""The xgrammar grammar backend driven through the contract, on SmolLM2's real
tokenizer and without a model: random walks over the allowed tokens (seeded,
uniform, ending at a stop token) produce text that parses and validates
against each JSON schema, fully matches each regex, or equals one choice;
accept/rollback/termination behave as the contract says; special tokens and
ids past the tokenizer are never allowed; what xgrammar cannot do is a
GrammarError that names the backend."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from fw.grammar import (Constraint, GrammarError, GrammarTokenizer, StructuredOutputsParams, allocate_token_bitmask,
                        bitmask_to_bool)
from fw.grammar.service import GrammarService, SequenceGrammar
from fw.plugins.manager import get_plugin_manager

from structured_cases import CHOICES, REGEX, SCHEMAS

xgrammar = pytest.importorskip("xgrammar")

from fw.backends.grammar.xgrammar_backend import python_dot  # noqa: E402
from fw.backends.grammar.xgrammar_schema import prepare_schema  # noqa: E402

VOCAB = 49152
STOPS = frozenset({0, 2})  # <|endoftext|>, <|im_end|>
PREFER_STOP_AFTER = 24
CAP = 400
# A stop token is preferred after PREFER_STOP_AFTER tokens; until one is allowed, so are these closers.
CLOSERS = (b'"', b"}", b"]", b".", b" ", b'"}', b'"]', b"}]", b"]}", b"}}", b"]]", b'"}]', b'"}}')


@pytest.fixture(scope="module")
def hf_tokenizer():
    from fw.default_model import bundled_smollm2
    from fw.model.gguf_file import GGUFModel
    return GGUFModel(bundled_smollm2()).tokenizer()


@pytest.fixture(scope="module")
def registry():
    return get_plugin_manager().registry("grammar_backend")


@pytest.fixture(scope="module")
def gt(hf_tokenizer) -> GrammarTokenizer:
    return GrammarTokenizer(hf_tokenizer, VOCAB, STOPS)


@pytest.fixture(scope="module")
def compiler(registry, gt):
    return registry.get("xgrammar").factory(gt)


class Walker:
    """Random walks through a compiled grammar, checking every mask on the way."""

    def __init__(self, gt: GrammarTokenizer, tokenizer_vocab: int):
        self.pieces = gt.token_bytes()
        self.vocab_size = gt.vocab_size
        self.tokenizer_vocab = tokenizer_vocab
        self.special = sorted(gt.special_token_ids - STOPS)
        self.stops = sorted(STOPS)
        closers = [i for i, p in enumerate(self.pieces) if p in CLOSERS]
        self.closer = torch.zeros(gt.vocab_size, dtype=torch.bool)
        self.closer[closers] = True
        self.bitmask = allocate_token_bitmask(1, gt.vocab_size)

    def allowed(self, matcher) -> torch.Tensor:
        self.bitmask.fill_(-1)
        matcher.fill_bitmask(self.bitmask, 0)
        allowed = bitmask_to_bool(self.bitmask, self.vocab_size)[0]
        assert not allowed[self.special].any(), "a special token was allowed"
        assert not allowed[self.tokenizer_vocab:].any(), "an id past the tokenizer's vocabulary was allowed"
        return allowed

    def walk(self, compiled, seed: int) -> str:
        """Text of one walk that ended on a stop token (asserts the walk ends)."""
        gen = torch.Generator().manual_seed(seed)
        matcher = compiled.matcher()
        tokens: list[int] = []
        for step in range(CAP):
            allowed = self.allowed(matcher)
            stop_ok = bool(allowed[self.stops].any())
            if stop_ok and step >= PREFER_STOP_AFTER:
                choice = self.stops[int(torch.randint(len(self.stops), (1,), generator=gen))]
            else:
                pool = allowed & self.closer if step >= PREFER_STOP_AFTER else allowed
                if not pool.any():
                    pool = allowed
                ids = pool.nonzero().flatten()
                assert len(ids), f"nothing allowed after {self.text(tokens)!r}"
                choice = int(ids[torch.randint(len(ids), (1,), generator=gen)])
            assert matcher.accept_token(choice), f"an allowed token {choice} was refused"
            if choice in STOPS:
                assert matcher.is_terminated()
                return self.text(tokens)
            assert not matcher.is_terminated()
            tokens.append(choice)
        raise AssertionError(f"the walk did not end within {CAP} tokens: {self.text(tokens)!r}")

    def text(self, tokens: list[int]) -> str:
        return b"".join(self.pieces[t] for t in tokens).decode("utf-8")

    def accept_text(self, matcher, text: str, hf_tokenizer) -> None:
        for token in hf_tokenizer.encode(text, add_special_tokens=False):
            assert matcher.accept_token(token), f"token {token} of {text!r} refused"


@pytest.fixture(scope="module")
def walker(gt, hf_tokenizer) -> Walker:
    return Walker(gt, len(hf_tokenizer.get_vocab()))


def json_schema(schema) -> Constraint:
    return StructuredOutputsParams(json=schema).constraint()


# -- registration -------------------------------------------------------------------------------


def test_registered_with_every_kind_and_wins_auto(registry) -> None:
    spec = registry.get("xgrammar")
    assert set(spec.constraint_kinds) == {"json_schema", "json_object", "regex", "choice", "grammar"}
    assert spec.priority == 20 and spec.available() is None
    assert all(s.priority < spec.priority for s in registry if s.name != "xgrammar")


# -- random walks -------------------------------------------------------------------------------

EXTRA_SCHEMAS = {
    "lengths_and_formats": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "minLength": 3, "maxLength": 6},
            "day": {"type": "string", "format": "date"},
            "n": {"type": "integer", "exclusiveMinimum": -3, "exclusiveMaximum": 3},
            "ratio": {"type": "number", "minimum": 0.5, "maximum": 1.5},
            "even": {"type": "integer", "multipleOf": 2, "minimum": 0, "maximum": 40},
        },
        "required": ["id", "day", "n", "ratio", "even"],
    },
    "refs_and_unions": {
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                            "required": ["x", "y"]}},
        "type": "object",
        "properties": {
            "start": {"$ref": "#/$defs/point"},
            "end": {"anyOf": [{"$ref": "#/$defs/point"}, {"type": "null"}]},
            "kind": {"const": "segment"},
            "extra": {"type": "object", "additionalProperties": {"type": "boolean"}, "maxProperties": 2},
        },
        "required": ["start", "end", "kind"],
    },
}


@pytest.mark.parametrize("name", list(SCHEMAS) + list(EXTRA_SCHEMAS))
def test_json_schema_walks_validate(compiler, walker, name) -> None:
    schema = SCHEMAS.get(name) or EXTRA_SCHEMAS[name]
    compiled = compiler.compile(json_schema(schema))
    for seed in range(3):
        text = walker.walk(compiled, seed)
        jsonschema.validate(json.loads(text), schema)  # json.loads: strict, so no raw control characters
        assert "\n" not in text  # compact: no whitespace outside strings but the separators' spaces


def test_json_object_walks_are_objects_and_arrays_are_refused(compiler, walker, hf_tokenizer) -> None:
    compiled = compiler.compile(Constraint("json_object"))
    for seed in range(4):
        assert isinstance(json.loads(walker.walk(compiled, seed)), dict)
    matcher = compiled.matcher()
    bracket = hf_tokenizer.convert_tokens_to_ids("[")
    assert not walker.allowed(matcher)[bracket] and not matcher.accept_token(bracket)


@pytest.mark.parametrize("pattern", [REGEX, r"\d{3}-\d{4}", r"(yes|no|maybe)( really)*", r"^[a-z]{2,5}@x\.(com|org)$",
                                     r"(\w+ ){1,4}\w+\.", r"[a-z]{150}", r"[A-Z].{0,10}!"])
def test_regex_walks_fully_match(compiler, walker, pattern) -> None:
    compiled = compiler.compile(Constraint("regex", pattern))
    for seed in range(3):
        text = walker.walk(compiled, seed)
        assert re.fullmatch(pattern, text), (pattern, text)


def test_regex_dot_is_pythons(compiler, walker, hf_tokenizer) -> None:
    """xgrammar's `.` also takes a newline; Python's `re` (the oracle users know) does not."""
    assert python_dot(r"a.b\.[.]c[^]a.].") == r"a[^\n]b\.[.]c[^]a.][^\n]"
    for pattern in (r"A.{0,10}!", r"A{130}."):  # the automaton path and, past 128 counts, compile_regex
        matcher = compiler.compile(Constraint("regex", pattern)).matcher()
        walker.accept_text(matcher, pattern.split("{")[0] * (130 if "130" in pattern else 1), hf_tokenizer)
        allowed = walker.allowed(matcher)
        assert allowed[hf_tokenizer.convert_tokens_to_ids("x")] and not allowed[walker.pieces.index(b"\n")]


def test_choice_walks_give_exactly_one_option(compiler, walker) -> None:
    options = tuple(CHOICES) + ('say "hi"', "back\\slash", "tab\there", "é 😀", "New York")
    compiled = compiler.compile(Constraint("choice", options))
    seen = {walker.walk(compiled, seed) for seed in range(24)}
    assert seen <= set(options) and len(seen) >= 4


def test_choice_that_prefixes_another_allows_stop_and_continuation(compiler, walker, hf_tokenizer) -> None:
    matcher = compiler.compile(Constraint("choice", ("New York", "New York City"))).matcher()
    walker.accept_text(matcher, "New York", hf_tokenizer)
    allowed = walker.allowed(matcher)
    assert allowed[list(STOPS)].all() and allowed[hf_tokenizer.encode(" City")[0]]


@pytest.mark.parametrize("grammar,oracle", [
    ('root ::= "(" num ("+" num)* ")"\nnum ::= [0-9]+', r"\([0-9]+(\+[0-9]+)*\)"),
    ('start: "x=" NUM (";" NUM)*\nNUM: /[0-9]{1,3}/', r"x=[0-9]{1,3}(;[0-9]{1,3})*"),
])
def test_ebnf_and_lark_grammar_walks(compiler, walker, grammar, oracle) -> None:
    compiled = compiler.compile(Constraint("grammar", grammar))
    for seed in range(3):
        text = walker.walk(compiled, seed)
        assert re.fullmatch(oracle, text), text


# -- the matcher contract -----------------------------------------------------------------------


def test_refused_token_changes_nothing(compiler, walker, hf_tokenizer) -> None:
    matcher = compiler.compile(json_schema(SCHEMAS["person"])).matcher()
    walker.accept_text(matcher, '{"name": "Al", "age": 4', hf_tokenizer)
    before = walker.allowed(matcher).clone()
    forbidden = [int(i) for i in (~before).nonzero().flatten()[:50]]
    for token in forbidden + [VOCAB + 5]:
        assert not matcher.accept_token(token)
    assert torch.equal(walker.allowed(matcher), before)


def test_rollback_restores_earlier_masks(compiler, walker) -> None:
    compiled = compiler.compile(json_schema(SCHEMAS["array_of_objects"]))
    gen = torch.Generator().manual_seed(7)
    matcher = compiled.matcher()
    masks, tokens = [], []
    for _ in range(12):
        allowed = walker.allowed(matcher)
        masks.append(allowed.clone())
        allowed[list(STOPS)] = False
        ids = allowed.nonzero().flatten()
        token = int(ids[torch.randint(len(ids), (1,), generator=gen)])
        assert matcher.accept_token(token)
        tokens.append(token)
    for k in (1, 5, 12):
        matcher.rollback(k)
        assert torch.equal(walker.allowed(matcher), masks[len(tokens) - k])
        for token in tokens[len(tokens) - k:]:
            assert matcher.accept_token(token)
    matcher.rollback(0)
    with pytest.raises(ValueError):
        matcher.rollback(-1)
    with pytest.raises(ValueError, match="roll back 13"):
        matcher.rollback(13)


def test_stop_tokens_follow_the_grammar_end(compiler, walker, hf_tokenizer) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    matcher = compiler.compile(json_schema(schema)).matcher()
    assert not walker.allowed(matcher)[list(STOPS)].any() and not matcher.accept_token(2)
    compiled = compiler.compile(Constraint("regex", r"[0-9]+"))
    matcher = compiled.matcher()
    walker.accept_text(matcher, "12", hf_tokenizer)
    allowed = walker.allowed(matcher)  # "12" can end or go on
    assert allowed[list(STOPS)].all() and allowed[hf_tokenizer.convert_tokens_to_ids("3")]
    matcher = compiler.compile(json_schema(schema)).matcher()
    walker.accept_text(matcher, '{"n": 5}', hf_tokenizer)
    allowed = walker.allowed(matcher)  # the object is closed: only a stop token
    assert allowed.nonzero().flatten().tolist() == sorted(STOPS)
    assert matcher.accept_token(2) and matcher.is_terminated()
    assert not matcher.accept_token(0) and not matcher.accept_token(17)
    assert walker.allowed(matcher).nonzero().flatten().tolist() == sorted(STOPS)
    matcher.rollback(1)  # the stop token undone: the matcher runs again
    assert not matcher.is_terminated() and matcher.accept_token(0)


def test_fill_writes_the_whole_row(compiler, walker, hf_tokenizer) -> None:
    matcher = compiler.compile(json_schema(SCHEMAS["enum_color"])).matcher()
    walker.accept_text(matcher, '{"color": "', hf_tokenizer)
    bitmask = allocate_token_bitmask(3, VOCAB)
    bitmask[1] = 0x5A5A5A5A
    matcher.fill_bitmask(bitmask, 1)
    matcher.fill_bitmask(bitmask, 2)
    assert torch.equal(bitmask[1], bitmask[2]) and (bitmask[0] == -1).all()
    assert bitmask_to_bool(bitmask[1:2], VOCAB)[0].sum() < 50


def test_no_id_past_the_tokenizer_is_ever_allowed(registry, hf_tokenizer) -> None:
    wide = GrammarTokenizer(hf_tokenizer, VOCAB + 64, STOPS)
    compiler = registry.get("xgrammar").factory(wide)
    walker = Walker(wide, VOCAB)
    assert walker.bitmask.shape == (1, (VOCAB + 64) // 32)
    for constraint in (Constraint("json_object"), json_schema(SCHEMAS["person"]), Constraint("regex", r".{1,20}")):
        text = walker.walk(compiler.compile(constraint), 1)  # Walker.allowed checks ids >= VOCAB each step
        assert text


def test_length_bounded_strings_never_allow_control_characters(compiler, walker, hf_tokenizer) -> None:
    """xgrammar's own maxLength grammar admits a raw tab; the pattern form it is rewritten to does not."""
    assert prepare_schema({"type": "string", "maxLength": 8}) == {"type": "string", "pattern": "^.{0,8}$"}
    assert prepare_schema({"type": "string", "maxLength": 500}) == {"type": "string", "maxLength": 500}
    matcher = compiler.compile(json_schema({"type": "string", "maxLength": 8})).matcher()
    walker.accept_text(matcher, '"ab', hf_tokenizer)
    allowed = walker.allowed(matcher)
    controls = [i for i, p in enumerate(walker.pieces) if p and any(b < 0x20 for b in p)]
    assert len(controls) > 10 and not allowed[controls].any()
    walker.accept_text(matcher, "cdefgh", hf_tokenizer)
    assert allowed[hf_tokenizer.convert_tokens_to_ids('"')]
    assert not walker.allowed(matcher)[hf_tokenizer.convert_tokens_to_ids("a")]  # 8 characters: no ninth


def test_batched_fill_matches_one_by_one(compiler, walker) -> None:
    constraints = [json_schema(s) for s in SCHEMAS.values()] + [Constraint("regex", REGEX), Constraint("json_object")]
    compiled = [compiler.compile(c) for c in constraints]
    gen = torch.Generator().manual_seed(3)
    matchers = []
    for i in range(64):
        matcher = compiled[i % len(compiled)].matcher()
        for _ in range(int(torch.randint(0, 10, (1,), generator=gen))):
            allowed = walker.allowed(matcher)
            allowed[list(STOPS)] = False
            ids = allowed.nonzero().flatten()
            if not len(ids):  # complete: only a stop token may follow
                break
            assert matcher.accept_token(int(ids[torch.randint(len(ids), (1,), generator=gen)]))
        matchers.append(matcher)
    done = compiler.compile(Constraint("choice", ("ok",))).matcher()
    assert done.accept_token(walker.pieces.index(b"ok")) and done.accept_token(2)
    for group in (matchers, matchers[:7] + [done] + matchers[7:]):  # a terminated one takes the row-by-row path
        rows = list(range(len(group)))
        batched, single = allocate_token_bitmask(len(group), VOCAB), allocate_token_bitmask(len(group), VOCAB)
        compiler.fill_bitmask_batch(group, batched, rows)
        for matcher, row in zip(group, rows):
            matcher.fill_bitmask(single, row)
        assert torch.equal(batched, single)


# -- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize("constraint,match", [
    (Constraint("json_schema", '{"type":"foo"}'), 'Unsupported type "foo"'),  # past fw's metaschema check
    (json_schema({"type": "array", "minItems": 3, "maxItems": 1}), "minItems is greater than maxItems"),
    (json_schema({"type": "string", "minLength": 4, "maxLength": 2}), "'minLength' 4 is greater than 'maxLength' 2"),
    (json_schema({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}),
     r"at #/properties/a: 'not' is not supported"),
    (json_schema({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}), "uniqueItems"),
    (json_schema({"type": "array", "contains": {"type": "integer"}}), "'contains'"),
    (json_schema({"type": "number", "multipleOf": 0.5}), "multipleOf"),
    (json_schema({"type": "string", "pattern": "(?=a)b"}), "Lookahead is not supported"),
    (json_schema({"type": "string", "pattern": "[a-z]+", "maxLength": 3}), "put the length into a pattern"),
    (json_schema(False), "cannot accept any value"),
    (Constraint("regex", "[a-"), r"Unclosed '\['"),
    (Constraint("regex", r"(a)\1"), "Backreference is not supported"),
    (Constraint("grammar", 'root ::= "a" | '), "EBNF parser error"),
    (Constraint("grammar", 'expr ::= "a"'), 'root rule with name "root" is not found'),
    (Constraint("grammar", "start: x"), "unknown name 'x'"),
])
def test_what_xgrammar_cannot_do_is_a_grammar_error(compiler, constraint, match) -> None:
    with pytest.raises(GrammarError, match=match) as info:
        compiler.compile(constraint)
    assert info.value.backend == "xgrammar" and "grammar backend 'xgrammar'" in str(info.value)
    assert "/project/cpp" not in str(info.value)  # xgrammar's source locations are stripped


# -- through the service ------------------------------------------------------------------------


def test_service_compiles_and_fills_with_xgrammar(registry, gt, walker) -> None:
    service = GrammarService(registry, gt, default_backend="xgrammar")
    try:
        params = StructuredOutputsParams(json=SCHEMAS["person"])
        assert service.backend_name(StructuredOutputsParams(regex="a+")) == "xgrammar"
        backend, compiled, compiler = service.new_grammar(params)
        assert backend == "xgrammar" and service.compile(params)[1] is compiled
        rows = [SequenceGrammar(backend, compiler, compiled.matcher()), None,
                SequenceGrammar(backend, compiler, service.new_grammar(StructuredOutputsParams(choice=CHOICES))[1]
                                .matcher())]
        bitmask, indices = service.fill_bitmask(rows)
        assert indices == [0, 2]
        for r, i in enumerate(indices):
            assert torch.equal(bitmask_to_bool(bitmask[r:r + 1], VOCAB)[0], walker.allowed(rows[i].matcher))
        with pytest.raises(GrammarError, match="xgrammar"):
            service.compile(StructuredOutputsParams(regex="[a-"))
        auto = GrammarService(registry, gt)
        assert auto.backend_name(params) == "xgrammar"
        auto.shutdown()
    finally:
        service.shutdown()
