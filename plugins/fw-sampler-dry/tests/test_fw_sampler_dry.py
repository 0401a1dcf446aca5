"""DRY on crafted logits: the token that would extend a repeated sequence is penalised by
multiplier * base ** (length - allowed_length), so greedy picks exactly the expected token;
sequence breakers (single tokens, inside tokens, and spanning several tokens) cut repeats;
penalty_last_n bounds the scan; the matcher agrees with a brute-force definition; parameters
are checked against the plugin's schema."""

from __future__ import annotations

import math
import random
import re

import pytest
import torch

from dry_testing import FakeSeq, ToyTokenizer, batch_of, dry, greedy, sample, sampler_pipeline  # first: the plugin
from fw.errors import InvalidRequestError
from fw.sampling.batch import SamplingBatch
from fw_sampler_dry.breakers import BreakerTable
from fw_sampler_dry.matching import Breakers, max_exponent, penalty, repeat_lengths
from fw_sampler_dry.plugin import Dry

VOCAB = ["a", "b", "c", "d", "e", "x", "y", "\n", ".\n", "<", "<b", "r>", ":"]
A, B, C, D, E, X, Y, NL, DOT_NL, LT, LT_B, R, COLON = range(len(VOCAB))


@pytest.fixture(scope="module")
def pipeline():
    return sampler_pipeline()


@pytest.fixture(scope="module")
def tokenizer():
    return ToyTokenizer(VOCAB)


def logits_with(**values: float) -> torch.Tensor:
    """One row of zeros over VOCAB, with the given tokens' logits set (by name: c=1.0)."""
    row = torch.zeros(len(VOCAB))
    for name, value in values.items():
        row[globals()[name.upper()]] = value
    return row


def rows_logits(row: torch.Tensor, n: int) -> torch.Tensor:
    return row.unsqueeze(0).repeat(n, 1)


def test_llama_cpp_worked_example():
    """llama.cpp's comment: in `a b c c b c y a b c`, emitting c extends `a b c` (3), b extends
    `c` (1) and y extends `b c` (2)."""
    history = [A, B, C, C, B, C, Y, A, B, C]
    assert repeat_lengths(history, allowed_length=1) == {C: 3, B: 1, Y: 2}
    assert repeat_lengths(history, allowed_length=2) == {C: 3, Y: 2}


def test_penalises_the_token_that_extends_the_repeat(pipeline):
    history = [A, B, C, X, A, B]  # `a b` was followed by c: c would repeat `a b c`
    rows = [(greedy([dry(multiplier=1.0, base=2.0, allowed_length=2)]), history),
            (greedy(), history),  # no DRY: untouched in the same batch
            (greedy([dry(multiplier=1.0, base=2.0, allowed_length=3)]), history)]  # repeat too short
    logits = rows_logits(logits_with(c=1.0, d=0.5), 3)
    assert sample(pipeline, rows, logits) == [D, C, C]


def test_penalty_grows_with_the_repeat_length(pipeline):
    history = [A, B, C, D, X, A, B, C]  # d would extend a repeat of 3: exponent 1
    logits = rows_logits(logits_with(d=3.0, e=1.5), 3)
    rows = [(greedy([dry(multiplier=1.0, base=2.0)]), history),  # 3 - 2 = 1 < 1.5
            (greedy([dry(multiplier=1.0, base=1.0)]), history),  # 3 - 1 = 2
            (greedy([dry(multiplier=0.5, base=2.0)]), history)]  # 3 - 1 = 2
    assert sample(pipeline, rows, logits) == [E, D, D]


def test_exact_logits_and_the_exponent_clamp():
    stage = Dry()
    args = dict(multiplier=0.8, base=1.75, allowed_length=2, sequence_breakers=[], penalty_last_n=-1)
    params = stage.prepare(args, None)
    history = [A, B, C, D, X, A, B, C]
    logits = torch.randn(1, len(VOCAB))
    out = stage.apply(logits.clone(), batch_of([(greedy(), history)], len(VOCAB)), [params])
    expected = logits.clone()
    expected[0, D] -= 0.8 * 1.75 ** 1
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    # a very long repeat: llama.cpp clamps the exponent so the penalty stays a finite float32
    assert max_exponent(1.75) == int(88.7228391 / math.log(1.75)) == 158
    assert penalty(1000, 0.8, 1.75, 2) == penalty(2 + 158, 0.8, 1.75, 2) == 0.8 * 1.75 ** 158
    long = [A, B, C, D, E] * 100
    out = stage.apply(torch.zeros(1, len(VOCAB)), batch_of([(greedy(), long)], len(VOCAB)), [params])
    assert torch.isfinite(out).all() and out[0, A] == -torch.tensor(0.8 * 1.75 ** 158, dtype=torch.float32)


@pytest.mark.parametrize("breaker_tokens", [[LT_B, R], [LT, B, R]], ids=["<b|r>", "<|b|r>"])
def test_a_multi_token_breaker_cuts_the_repeat(pipeline, tokenizer, breaker_tokens):
    """`<br>` spans two or three tokens; the repeat `<br> x a b` is cut to `x a b` (3: penalty 2)
    instead of 5 or 6 tokens (penalty 8 or 16)."""
    history = [*breaker_tokens, X, A, B, C, E, *breaker_tokens, X, A, B]
    logits = rows_logits(logits_with(c=4.0, d=1.0), 2)
    rows = [(greedy([dry(multiplier=1.0, base=2.0, sequence_breakers=["<br>"])]), history),
            (greedy([dry(multiplier=1.0, base=2.0, sequence_breakers=[])]), history)]
    assert sample(pipeline, rows, logits, tokenizer) == [C, D]


def test_a_newline_breaker_cuts_the_repeat(pipeline, tokenizer):
    history = [X, NL, A, B, C, E, X, NL, A, B]  # `x \n a b` repeats; after the breaker only `a b`
    logits = rows_logits(logits_with(c=2.0, d=0.5), 2)
    rows = [(greedy([dry(multiplier=1.0, base=2.0, sequence_breakers=["\n"])]), history),  # penalty 1
            (greedy([dry(multiplier=1.0, base=2.0, sequence_breakers=[])]), history)]  # penalty 4
    assert sample(pipeline, rows, logits, tokenizer) == [C, D]


def test_a_breaker_token_is_never_penalised(pipeline, tokenizer):
    history = [A, NL, B, A]  # `a` was followed by "\n"
    logits = rows_logits(logits_with(**{"nl": 1.0, "d": 0.5}), 2)
    rows = [(greedy([dry(multiplier=1.0, base=2.0, allowed_length=1, sequence_breakers=["\n"])]), history),
            (greedy([dry(multiplier=1.0, base=2.0, allowed_length=1, sequence_breakers=[])]), history)]
    assert sample(pipeline, rows, logits, tokenizer) == [NL, D]


def test_a_breaker_inside_a_token_counts(pipeline, tokenizer):
    """".\\n" contains "\\n": ending on it leaves no repeat to penalise."""
    history = [A, B, C, A, B, DOT_NL, A, B]
    logits = rows_logits(logits_with(c=2.0, d=0.5), 2)
    rows = [(greedy([dry(multiplier=10.0, sequence_breakers=["\n"])]), history + [DOT_NL]),
            (greedy([dry(multiplier=10.0, sequence_breakers=["\n"])]), history)]  # `a b` then c: penalised
    assert sample(pipeline, rows, logits, tokenizer) == [C, D]


def test_penalty_last_n_bounds_the_scan(pipeline):
    history = [A, B, C, X, X, X, X, A, B]
    logits = rows_logits(logits_with(c=1.0, d=0.5), 3)
    rows = [(greedy([dry(multiplier=1.0, penalty_last_n=-1)]), history),
            (greedy([dry(multiplier=1.0, penalty_last_n=4)]), history),  # `x x a b`: no earlier `b`
            (greedy([dry(multiplier=1.0, penalty_last_n=0)]), history)]  # off
    assert sample(pipeline, rows, logits) == [D, C, C]


def test_breaker_table_from_strings(tokenizer):
    table = BreakerTable(tokenizer)
    assert table.breakers(["\n"]).heads == {NL: ((),), DOT_NL: ((),)}
    assert table.breakers(["<br>"]).heads == {LT: ((B, R),), LT_B: ((R,),)}
    both = table.breakers(["\n", "<br>", ":"])
    assert both.single == {NL, DOT_NL, COLON}
    assert table.breakers(["\n", "<br>", ":"]) is both  # cached per list


def brute_force(tokens, allowed_length, last_n, breakers: set[int]) -> dict[int, int]:
    """DRY's definition, directly: the longest suffix of the window (not reaching back past a
    breaker) that also ends at position i, for every i, credited to the token after i."""
    if last_n == 0:
        return {}
    window = tokens[-last_n:] if last_n > 0 else tokens
    n = len(window)
    if n <= allowed_length:
        return {}
    limit = next((k for k in range(n) if window[n - 1 - k] in breakers), n)
    out: dict[int, int] = {}
    for i in range(n - 1):
        length = 0
        while length <= i and window[i - length] == window[n - 1 - length]:
            length += 1
        length = min(length, limit)
        if length >= allowed_length and length > out.get(window[i + 1], 0):
            out[window[i + 1]] = length
    return out


def test_matches_the_brute_force_definition():
    rng = random.Random(0)
    for _ in range(3000):
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 40))]
        allowed = rng.randint(1, 4)
        last_n = rng.choice([-1, 0, 5, 17, 100])
        single = set(rng.sample(range(4), rng.randint(0, 1)))
        breakers = Breakers({t: ((),) for t in single})
        assert repeat_lengths(tokens, allowed, last_n, breakers) == brute_force(tokens, allowed, last_n, single), (
            tokens, allowed, last_n, single)


def test_defaults_and_parameter_errors(pipeline, tokenizer):
    stage = pipeline.per_request["dry"][1]
    params = greedy([{"name": "dry"}])
    pipeline.validate(params, tokenizer)
    prepared = params.samplers[0].prepared[id(stage)]
    assert (prepared.multiplier, prepared.base, prepared.allowed_length, prepared.penalty_last_n) == (0.8, 1.75, 2, -1)
    assert prepared.breakers.single == {NL, DOT_NL, COLON}  # "\n", ":", '"', "*": the last two are not in VOCAB
    for args, message in [
        (dict(multiplier=-1), "samplers: dry: multiplier: -1 is less than the minimum of 0"),
        (dict(base=0.5), "samplers: dry: base: 0.5 is less than the minimum of 1"),
        (dict(allowed_length=0), "samplers: dry: allowed_length: 0 is less than the minimum of 1"),
        (dict(allowed_length=2.5), "samplers: dry: allowed_length: 2.5 is not of type 'integer'"),
        (dict(sequence_breakers=[""]), "samplers: dry: sequence_breakers.0: '' should be non-empty"),
        (dict(sequence_breakers="\n"), "samplers: dry: sequence_breakers: '\\n' is not of type 'array'"),
        (dict(penalty_last_n=-2), "samplers: dry: penalty_last_n: -2 is less than the minimum of -1"),
        (dict(multipler=1.0), "samplers: dry: Additional properties are not allowed ('multipler' was unexpected)"),
        (dict(multiplier=float("nan")), "samplers: dry: multiplier must be a finite number, got nan"),
    ]:
        with pytest.raises(InvalidRequestError, match="^" + re.escape(message) + "$"):
            pipeline.validate(greedy([{"name": "dry", **args}]), tokenizer)
    with pytest.raises(InvalidRequestError, match="sequence_breakers need the model's tokenizer"):
        sampler_pipeline().validate(greedy([{"name": "dry"}]))  # no tokenizer for the default breakers


def test_each_row_scans_its_own_history():
    stage = Dry()
    params = stage.prepare(dict(multiplier=1.0, base=2.0, allowed_length=2, sequence_breakers=[],
                                penalty_last_n=-1), None)
    seqs = [FakeSeq(greedy(), [A, B, C, X, A, B]), FakeSeq(greedy(), [A, B, D, X, A, B]),
            FakeSeq(greedy(), [E, E, E])]
    batch = SamplingBatch(seqs, len(VOCAB), torch.device("cpu"), frozenset())
    out = stage.apply(torch.zeros(3, len(VOCAB)), batch, [params] * 3)
    assert out[0].nonzero().flatten().tolist() == [C] and out[0, C] == -1.0
    assert out[1].nonzero().flatten().tolist() == [D] and out[1, D] == -1.0
    assert out[2].nonzero().flatten().tolist() == [E] and out[2, E] == -1.0  # `e e` then e: length 2
