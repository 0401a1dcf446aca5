"""JSON schemas made safe and fast for xgrammar 0.2.8 before it compiles them.

Safe: xgrammar silently ignores some keywords (`not`, `if`/`then`/`else`,
`uniqueItems`, `dependentRequired`, `multipleOf` on numbers, lengths next to a
`pattern` or `format`, lookarounds inside a pattern, `allOf` of several
schemas) and compiles `contains` into "only `[]`"; output under such a
grammar can fail the schema, so those schemas are refused with the keyword
and its location instead.

Fast: xgrammar compiles `minLength`/`maxLength` into a counted repetition
that its matcher re-evaluates against the whole vocabulary at every step
inside the string (milliseconds per mask fill: docs/performance.md), and
whose character class admits raw control characters, which JSON forbids. The
same length as a `pattern` (`^.{min,max}$`, which xgrammar compiles into a
finite automaton whose states' token masks are precomputed, and whose JSON
string mode excludes control characters, quotes and backslashes) fills
orders of magnitude faster. xgrammar fails on patterns with more than 128 counted
characters, so longer bounds keep its own repetition."""

from __future__ import annotations

import re
from typing import Any

from fw.grammar import GrammarError

NAME = "xgrammar"
# The longest counted repetition xgrammar 0.2.8 compiles inside a pattern (129 trips an internal check).
MAX_COUNTED_PATTERN = 128
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: " and may add "Check failed: ... is false: ".
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (?:Check failed: .*? is false: )?")
_IGNORED_KEYWORDS = {
    "not": "'not'",
    "if": "'if'/'then'/'else'",
    "then": "'if'/'then'/'else'",
    "else": "'if'/'then'/'else'",
    "contains": "'contains'",
    "minContains": "'minContains'",
    "maxContains": "'maxContains'",
    "dependentRequired": "'dependentRequired'",
    "dependentSchemas": "'dependentSchemas'",
    "dependencies": "'dependencies'",
}
# Where a schema nests sub-schemas: 'one' (a schema), 'list' (schemas), 'map' (name -> schema).
# Everything else (enum, const, default, examples, ...) is data and is left alone.
_SUBSCHEMAS = {
    "properties": "map", "patternProperties": "map", "$defs": "map", "definitions": "map",
    "items": "one_or_list", "prefixItems": "list", "additionalItems": "one", "unevaluatedItems": "one",
    "additionalProperties": "one", "unevaluatedProperties": "one", "propertyNames": "one",
    "anyOf": "list", "oneOf": "list", "allOf": "list",
}


def prepare_schema(schema: Any, path: str = "#") -> Any:
    """`schema` checked (GrammarError for what xgrammar would get wrong) with string lengths
    rewritten as patterns where that is faster; the input is not modified."""
    if not isinstance(schema, dict):
        return schema
    _check_keywords(schema, path)
    out = dict(schema)
    pattern = _length_pattern(schema, path)
    if pattern is not None:
        out.pop("minLength", None)
        out.pop("maxLength", None)
        out["pattern"] = pattern
    for key, shape in _SUBSCHEMAS.items():
        sub = schema.get(key)
        if sub is None:
            continue
        if shape == "map" and isinstance(sub, dict):
            out[key] = {name: prepare_schema(child, f"{path}/{key}/{name}") for name, child in sub.items()}
        elif shape in ("list", "one_or_list") and isinstance(sub, list):
            out[key] = [prepare_schema(child, f"{path}/{key}/{i}") for i, child in enumerate(sub)]
        elif shape in ("one", "one_or_list"):
            out[key] = prepare_schema(sub, f"{path}/{key}")
    return out


def _check_keywords(schema: dict, path: str) -> None:
    for key, feature in _IGNORED_KEYWORDS.items():
        if key in schema:
            _unsupported(path, f"{feature} is not supported")
    if schema.get("uniqueItems") is True:
        _unsupported(path, "'uniqueItems': true is not supported")
    if "multipleOf" in schema and not (schema.get("type") == "integer" and _positive_int(schema["multipleOf"])):
        _unsupported(path, "'multipleOf' is supported only with \"type\": \"integer\" and an integer divisor")
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        _unsupported(path, "'allOf' with more than one schema is not supported (merge them into one schema)")
    has_length = "minLength" in schema or "maxLength" in schema
    for key in ("pattern", "format"):
        if key in schema and has_length:
            _unsupported(path, f"'{key}' together with 'minLength'/'maxLength' is not supported "
                               "(put the length into a pattern instead, e.g. ^[a-z]{2,8}$)")
    if "pattern" in schema:
        _check_pattern(schema["pattern"], path + "/pattern")
    for name in schema.get("patternProperties") or {}:
        _check_pattern(name, f"{path}/patternProperties")


def _length_pattern(schema: dict, path: str) -> str | None:
    """`^.{min,max}$` for a length-bounded string schema the pattern form handles, else None."""
    types = schema.get("type")
    is_string = types == "string" or (isinstance(types, list) and "string" in types)
    if not is_string or not ("minLength" in schema or "maxLength" in schema):
        return None
    if "enum" in schema or "const" in schema:
        return None
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    if not _non_negative_int(low) or not (high is None or _non_negative_int(high)):
        _unsupported(path, "'minLength' and 'maxLength' must be non-negative integers")
    if high is not None and low > high:
        _unsupported(path, f"'minLength' {low} is greater than 'maxLength' {high}: no string fits")
    if (high if high is not None else low) > MAX_COUNTED_PATTERN:
        return None
    return "^.{%d,%s}$" % (low, "" if high is None else high)


def _check_pattern(pattern: Any, path: str) -> None:
    """Inside a schema xgrammar warns about and ignores what its regex parser lacks (lookarounds);
    compiled alone, the parser says what it lacks."""
    import xgrammar as xgr  # here: xgrammar costs start-up time
    if not isinstance(pattern, str):
        _unsupported(path, f"a pattern must be a string, got {type(pattern).__name__}")
    try:
        xgr.Grammar.from_regex(pattern)
    except RuntimeError as exc:
        _unsupported(path, f"pattern {pattern!r}: {error_reason(exc)}")


def error_reason(exc: BaseException) -> str:
    """xgrammar's error text without its "[time] /path/file.cc:line: Check failed: ..." prefixes."""
    lines = [_LOG_PREFIX.sub("", line) for line in str(exc).strip().splitlines()]
    return "\n".join(line for line in lines if line.strip()) or type(exc).__name__


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _non_negative_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _unsupported(path: str, why: str) -> None:
    raise GrammarError(NAME, f"JSON schema at {path}: {why}")
