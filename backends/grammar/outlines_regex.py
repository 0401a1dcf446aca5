"""Regular expressions the outlines backend builds itself, in the syntax
outlines-core compiles (Rust's `regex`): escaped literals, decimal ranges for
JSON-schema numeric bounds (outlines-core ignores `minimum`/`maximum`), and
JSON-schema string patterns rewritten to match a string's JSON text.

Every function returns a regex whose language is a subset of what the schema
allows, never a superset: output that follows it always validates.
Failures raise `PatternError`; the schema layer turns it into a GrammarError."""

from __future__ import annotations

from decimal import Decimal

try:  # the standard library's regex parser (a private module: re._parser since 3.11, sre_parse before)
    import re._constants as _sre
    import re._parser as _sre_parse
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as _sre  # type: ignore[no-redef]
    import sre_parse as _sre_parse  # type: ignore[no-redef]

MAX_CODEPOINT = 0x10FFFF
_SURROGATES = (0xD800, 0xDFFF)  # not characters: UTF-8 cannot encode them, Rust's regex refuses them


# Longest numbers the backend writes where the schema sets no bound: integer digits (2^53, the
# integers a double holds exactly, has 16), fraction digits, exponent digits.
INTEGER_DIGITS = 16
FRACTION_DIGITS = 10
EXPONENT_DIGITS = 3


class PatternError(ValueError):
    """A pattern or range this module cannot turn into a regex; the message says why."""


# -- literals -----------------------------------------------------------------------------------

def literal(text: str) -> str:
    """`text` as a regex matching exactly it: ASCII letters, digits, '_' and ' ' as themselves,
    every other character as `\\x{HEX}` (valid in Rust's syntax whatever the character)."""
    return "".join(c if (c.isascii() and (c.isalnum() or c in "_ ")) else f"\\x{{{ord(c):X}}}" for c in text)


def alternation(options: list[str]) -> str:
    """A non-capturing group of the options (just the option when there is one)."""
    return options[0] if len(options) == 1 else "(?:" + "|".join(options) + ")"


def choice_regex(choices: tuple[str, ...] | list[str]) -> str:
    """Exactly one of `choices`, as text."""
    return alternation([literal(c) for c in choices])


# -- integer ranges -----------------------------------------------------------------------------

def _digit_class(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"[{lo}-{hi}]"


def _any_digits(n: int) -> str:
    return "" if n == 0 else "[0-9]" if n == 1 else f"[0-9]{{{n}}}"


def _same_length(lo: str, hi: str) -> str:
    """Digit strings of len(lo) == len(hi) between lo and hi inclusive (lo <= hi)."""
    n = len(lo)
    if lo == hi:
        return lo
    if lo[0] == hi[0]:
        return lo[0] + _same_length(lo[1:], hi[1:])
    rest = n - 1
    a, b = int(lo[0]), int(hi[0])
    parts = []
    first = a if lo[1:] == "0" * rest else a + 1
    if first != a:
        parts.append(str(a) + _group(_same_length(lo[1:], "9" * rest)))
    last = b if hi[1:] == "9" * rest else b - 1
    if first <= last:
        parts.append(_digit_class(first, last) + _any_digits(rest))
    if last != b:
        parts.append(str(b) + _group(_same_length("0" * rest, hi[1:])))
    return alternation(parts)


def _group(regex: str) -> str:
    """`regex` safe to follow with a quantifier or to concatenate (digit strings need no group)."""
    return regex if regex.isdigit() else f"(?:{regex})"


def nonnegative_int_range(lo: int, hi: int | None) -> str | None:
    """JSON spellings (no leading zeros) of the integers in [lo, hi], lo >= 0; hi None: up to
    INTEGER_DIGITS digits (see the module's caps). None when the range is empty."""
    if hi is None:
        hi = int("9" * max(INTEGER_DIGITS, len(str(lo))))
    if hi < lo:
        return None
    parts = []
    if lo == 0:
        parts.append("0")
        lo = 1
        if hi == 0:
            return "0"
    low, high = str(lo), str(hi)
    if len(high) == len(low):
        parts.append(_same_length(low, high))
    else:
        parts.append(_same_length(low, "9" * len(low)))
        parts.extend("[1-9]" + _any_digits(k - 1) for k in range(len(low) + 1, len(high)))
        parts.append(_same_length("1" + "0" * (len(high) - 1), high))
    return alternation(parts)


def int_range(lo: int | None, hi: int | None) -> str | None:
    """JSON integers in [lo, hi] (either side None: unbounded up to INTEGER_DIGITS digits; never
    "-0"); None when empty."""
    if lo is not None and hi is not None and lo > hi:
        return None
    parts = []
    if hi is None or hi >= 0:
        nonneg = nonnegative_int_range(max(lo, 0) if lo is not None else 0, hi)
        if nonneg is not None:
            parts.append(nonneg)
    if lo is None or lo < 0:  # -y with y in [max(1, -hi), -lo]
        y_lo = -hi if hi is not None and hi < 0 else 1
        neg = nonnegative_int_range(y_lo, -lo if lo is not None else None)
        if neg is not None:
            parts.append("-" + _group(neg))
    return alternation(parts) if parts else None


# -- decimal ranges -----------------------------------------------------------------------------

def _split(value: Decimal) -> tuple[int, str]:
    """(integer part, fraction digits without trailing zeros) of a value >= 0."""
    text = format(value, "f")
    whole, _, frac = text.partition(".")
    return int(whole), frac.rstrip("0")


def _upto(n: int) -> str:
    """1 to n digits."""
    return "[0-9]" if n == 1 else f"[0-9]{{1,{n}}}"


def _positive(room: int) -> str:
    """1 to `room` digits, not all zero."""
    return "[1-9]" if room == 1 else f"[1-9][0-9]{{0,{room - 1}}}|0(?:{_positive(room - 1)})"


def _fraction(lo: str, hi: str | None, lo_strict: bool, hi_strict: bool, room: int) -> tuple[str | None, bool]:
    """Digit strings G of at most `room` digits with lo <= 0.G <= hi (strict where asked), lo/hi
    as fraction digits without trailing zeros, hi None meaning "below 1" (no upper bound).
    Returns (regex for the non-empty G, whether the empty G, of value 0, qualifies)."""
    empty = lo == "" and not lo_strict and (hi is None or hi != "" or not hi_strict)
    if room == 0:
        return None, empty
    if hi == "":  # an upper bound of exactly 0: only zeros, and only when 0 is inside
        zeros = "0" if room == 1 else f"0{{1,{room}}}"
        return (zeros if lo == "" and not lo_strict and not hi_strict else None), empty
    if lo == "" and hi is None:
        return (_upto(room), empty) if not lo_strict else (_positive(room), False)
    l0, lo_rest = (int(lo[0]), lo[1:].rstrip("0")) if lo else (0, "")
    h0, hi_rest = (9, None) if hi is None else (int(hi[0]), hi[1:].rstrip("0"))
    alts: list[str] = []

    def add(digit: int, tail: tuple[str | None, bool]) -> None:
        regex, tail_empty = tail
        if regex is not None:
            alts.append(f"{digit}(?:{regex})" + ("?" if tail_empty else ""))
        elif tail_empty:
            alts.append(str(digit))

    if l0 == h0:
        add(l0, _fraction(lo_rest, hi_rest, lo_strict, hi_strict, room - 1))
    else:
        add(l0, _fraction(lo_rest, None, lo_strict, False, room - 1))
        if h0 - l0 > 1:
            alts.append(_digit_class(l0 + 1, h0 - 1) + ("" if room == 1 else f"[0-9]{{0,{room - 1}}}"))
        add(h0, _fraction("", hi_rest, False, hi_strict, room - 1))
    return ("|".join(alts) or None), empty


def _with_fraction(whole: str, fraction: tuple[str | None, bool]) -> str | None:
    regex, empty = fraction
    if regex is not None:
        return f"{whole}(?:\\.(?:{regex}))" + ("?" if empty else "")
    return whole if empty else None


def _nonnegative_number_range(lo: Decimal, lo_strict: bool, hi: Decimal | None, hi_strict: bool,
                              room: int) -> list[str]:
    a, fa = _split(lo)
    parts: list[str | None] = []
    if hi is not None:
        b, fb = _split(hi)
        if a == b:
            return [p for p in [_with_fraction(str(a), _fraction(fa, fb, lo_strict, hi_strict, room))] if p]
    parts.append(_with_fraction(str(a), _fraction(fa, None, lo_strict, False, room)))
    middle = nonnegative_int_range(a + 1, b - 1 if hi is not None else None)
    if middle is not None:
        parts.append(_group(middle) + f"(?:\\.{_upto(room)})?")
    if hi is not None:
        parts.append(_with_fraction(str(b), _fraction("", fb, False, hi_strict, room)))
    return [p for p in parts if p]


def number_range(lo: Decimal | None, hi: Decimal | None, lo_strict: bool = False,
                 hi_strict: bool = False) -> str | None:
    """JSON numbers in the interval from lo to hi (None: unbounded; strict: excluded), without
    exponent, never "-0", with at most FRACTION_DIGITS fraction digits (more where a bound has
    more) and INTEGER_DIGITS integer digits on an unbounded side; None when the interval is
    empty."""
    if lo is not None and hi is not None and (lo > hi or (lo == hi and (lo_strict or hi_strict))):
        return None
    room = max([FRACTION_DIGITS] + [len(_split(abs(v))[1]) + 1 for v in (lo, hi) if v is not None])
    parts: list[str] = []
    if hi is None or hi > 0 or (hi == 0 and not hi_strict):
        if lo is not None and lo >= 0:
            parts += _nonnegative_number_range(lo, lo_strict, hi, hi_strict, room)
        else:
            parts += _nonnegative_number_range(Decimal(0), False, hi, hi_strict, room)
    if lo is None or lo < 0:  # -y with y > 0 in [max(0, -hi), -lo]
        y_lo, y_lo_strict = (-hi, hi_strict) if hi is not None and hi < 0 else (Decimal(0), True)
        negative = _nonnegative_number_range(y_lo, y_lo_strict, -lo if lo is not None else None, lo_strict, room)
        if negative:
            parts.append("-" + _group(alternation(negative)))
    return alternation(parts) if parts else None


# -- JSON numbers of bounded length ---------------------------------------------------------------

def capped_json_numbers(regex: str) -> str:
    """`regex` (from outlines-core) with its unbounded JSON number and integer sub-patterns capped
    at INTEGER_DIGITS / FRACTION_DIGITS / EXPONENT_DIGITS digits. A sampled model can otherwise
    write digits until it runs out of tokens. The constants' text cannot come from a user's
    pattern or enum (those are escaped), so a textual replacement is exact."""
    from outlines_core.json_schema import INTEGER, NUMBER  # here: outlines_core costs start-up time
    whole = f"-?(?:0|[1-9][0-9]{{0,{INTEGER_DIGITS - 1}}})"
    number = f"{whole}(?:\\.[0-9]{{1,{FRACTION_DIGITS}}})?(?:[eE][+-]?[0-9]{{1,{EXPONENT_DIGITS}}})?"
    return regex.replace(NUMBER, f"(?:{number})").replace(INTEGER, f"(?:{whole})")


# -- JSON-schema string patterns ----------------------------------------------------------------

_JSON_SHORT_ESCAPES = {0x22: '\\"', 0x5C: "\\\\", 0x08: "\\b", 0x0C: "\\f", 0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t"}
_UNSAFE = [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C)]  # must be escaped inside a JSON string
_PRINTABLE_ASCII = [(0x20, 0x7E)]
_WORD = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
_DIGIT = [(0x30, 0x39)]
_SPACE = [(0x09, 0x0D), (0x20, 0x20)]
# Positive categories use their ASCII members (a subset of both Python's and ECMA-262's reading);
# negated ones their printable-ASCII members, for the same reason.
_CATEGORIES = {
    _sre.CATEGORY_DIGIT: (_DIGIT, False), _sre.CATEGORY_NOT_DIGIT: (_DIGIT, True),
    _sre.CATEGORY_WORD: (_WORD, False), _sre.CATEGORY_NOT_WORD: (_WORD, True),
    _sre.CATEGORY_SPACE: (_SPACE, False), _sre.CATEGORY_NOT_SPACE: (_SPACE, True),
}
_START = (_sre.AT_BEGINNING, _sre.AT_BEGINNING_STRING)
_END = (_sre.AT_END, _sre.AT_END_STRING)


def _normalize(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _subtract(ranges: list[tuple[int, int]], minus: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out = []
    for lo, hi in _normalize(ranges):
        pieces = [(lo, hi)]
        for m_lo, m_hi in minus:
            pieces = [p for a, b in pieces for p in ((a, min(b, m_lo - 1)), (max(a, m_hi + 1), b)) if p[0] <= p[1]]
        out.extend(pieces)
    return out


def _intersect(ranges: list[tuple[int, int]], keep: list[tuple[int, int]]) -> list[tuple[int, int]]:
    return _normalize([(max(a, c), min(b, d)) for a, b in ranges for c, d in keep if max(a, c) <= min(b, d)])


def _complement(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    return _subtract([(0, MAX_CODEPOINT)], _normalize(ranges))


def _char_set(ranges: list[tuple[int, int]], escape_controls: bool) -> str:
    """A regex for one character of `ranges` as it appears in JSON text: '"' and '\\' (and control
    characters when `escape_controls`, else they are left out) as their JSON escapes."""
    ranges = _subtract(_normalize(ranges), [_SURROGATES])
    safe = _subtract(ranges, _UNSAFE)
    options = []
    if len(safe) == 1 and safe[0][0] == safe[0][1]:
        options.append(literal(chr(safe[0][0])))
    elif safe:
        options.append("[" + "".join(f"\\x{{{lo:X}}}" if lo == hi else f"\\x{{{lo:X}}}-\\x{{{hi:X}}}"
                                     for lo, hi in safe) + "]")
    for lo, hi in _intersect(ranges, _UNSAFE):
        for code in range(lo, hi + 1):
            if code in (0x22, 0x5C) or escape_controls:
                options.append(literal(_JSON_SHORT_ESCAPES.get(code, f"\\u{code:04x}")))
    if not options:
        raise PatternError("a character class in the pattern admits no character a JSON string can hold")
    return alternation(options)


def _in_class(items: list) -> str:
    negate = False
    ranges: list[tuple[int, int]] = []
    has_category = False
    for op, arg in items:
        if op is _sre.NEGATE:
            negate = True
        elif op is _sre.LITERAL:
            ranges.append((arg, arg))
        elif op is _sre.RANGE:
            ranges.append(arg)
        elif op is _sre.CATEGORY and arg in _CATEGORIES:
            members, negated = _CATEGORIES[arg]
            has_category = True
            ranges.extend(_subtract(_PRINTABLE_ASCII, members) if negated else members)
        else:
            raise PatternError(f"the pattern uses {op} {arg} inside a character class, which the outlines "
                               "backend does not translate")
    if not negate:
        return _char_set(ranges, escape_controls=True)
    # [^...]: every other character; with a category inside, only printable ASCII (see _CATEGORIES)
    universe = _PRINTABLE_ASCII if has_category else [(0, MAX_CODEPOINT)]
    return _char_set(_intersect(_complement(ranges), universe), escape_controls=False)


def _translate(items, dotall: bool, top: bool) -> str:
    out = []
    last = len(items) - 1
    for i, (op, arg) in enumerate(items):
        if op is _sre.LITERAL:
            out.append(_char_set([(arg, arg)], escape_controls=True))
        elif op is _sre.NOT_LITERAL:
            out.append(_char_set(_complement([(arg, arg)]), escape_controls=False))
        elif op is _sre.ANY:
            out.append(_char_set([(0, MAX_CODEPOINT)] if dotall else _complement([(0x0A, 0x0A)]),
                                 escape_controls=False))
        elif op is _sre.IN:
            out.append(_in_class(arg))
        elif op is _sre.CATEGORY and arg in _CATEGORIES:
            out.append(_in_class([(op, arg)]))
        elif op in (_sre.MAX_REPEAT, _sre.MIN_REPEAT):
            lo, hi, sub = arg
            bound = f"{{{lo},}}" if hi == _sre.MAXREPEAT else f"{{{lo}}}" if lo == hi else f"{{{lo},{hi}}}"
            out.append(f"(?:{_translate(list(sub), dotall, False)}){bound}")
        elif op is _sre.SUBPATTERN:
            _group_id, add_flags, del_flags, sub = arg
            if add_flags or del_flags:
                raise PatternError("the pattern sets flags inside a group, which the outlines backend does not "
                                   "translate")
            out.append(f"(?:{_translate(list(sub), dotall, False)})")
        elif op is _sre.BRANCH:
            out.append("(?:" + "|".join(_translate(list(b), dotall, False) for b in arg[1]) + ")")
        elif op is _sre.AT and ((arg in _START and top and i == 0) or (arg in _END and top and i == last)):
            continue  # the pattern already matches the whole string
        else:
            what = {_sre.AT: "an anchor or word boundary inside the pattern", _sre.GROUPREF: "a back-reference",
                    _sre.ASSERT: "a look-ahead/look-behind", _sre.ASSERT_NOT: "a negative look-around",
                    _sre.GROUPREF_EXISTS: "a conditional group"}.get(op, f"{op} {arg}")
            raise PatternError(f"the outlines backend cannot compile {what}")
    return "".join(out)


def json_string_pattern(pattern: str) -> str:
    """The JSON-schema `pattern` as a regex over the string's JSON text (without the quotes), whole
    string matched. Characters JSON must escape come out as their escapes, so the output is
    always valid JSON; `\\d`, `\\w`, `\\s` stand for their ASCII members, `\\D`, `\\W`, `\\S` and
    classes like `[^\\d]` for their printable-ASCII members, and control characters come only
    from patterns that name them."""
    try:
        parsed = _sre_parse.parse(pattern)
    except Exception as exc:  # re.error
        raise PatternError(f"the pattern {pattern!r} is not a valid regular expression: {exc}") from None
    flags = parsed.state.flags
    if flags & (_sre.SRE_FLAG_IGNORECASE | _sre.SRE_FLAG_LOCALE):
        raise PatternError("the pattern sets case-insensitive or locale flags, which the outlines backend does "
                           "not translate; spell the cases out ([Aa])")
    return _translate(list(parsed), bool(flags & _sre.SRE_FLAG_DOTALL), True)
