"""JSON schema -> regex for the outlines backend: outlines-core's
`build_regex_from_schema`, with what it would get wrong fixed or refused.

outlines-core 0.2 compiles a schema node by the first of `properties`, `allOf`,
`anyOf`, `oneOf`, `prefixItems`, `enum`, `const`, `$ref`, `type` it finds and
ignores the rest, so several keywords would pass silently and let through
output that fails the schema. This module walks a copy of the schema first:
- numeric bounds (`minimum`, `maximum`, `exclusiveMinimum`, `exclusiveMaximum`),
  which outlines-core ignores, become decimal-range regexes (outlines_regex),
  and numbers without bounds get a bounded number of digits (a sampled model
  would otherwise write digits until it runs out of tokens);
- string `pattern`s are rewritten to match the string's JSON text, so a
  pattern like `.` cannot emit a bare `"` and break the JSON;
- keywords it would ignore (`not`, `if`, `uniqueItems`, `multipleOf`, a
  `required` name with no property, an `allOf` of several schemas, a pattern
  together with a length, ...) raise `SchemaError` naming the keyword and path.
"""

from __future__ import annotations

import copy
import json
import math
import secrets
from decimal import Decimal, InvalidOperation
from typing import Any

from fw.backends.grammar.outlines_regex import (PatternError, capped_json_numbers, int_range, json_string_pattern,
                                                number_range)


class SchemaError(ValueError):
    """A schema the outlines backend cannot compile faithfully; the message says why and where."""


# Keywords outlines-core ignores that restrict the valid values: refused rather than dropped.
_IGNORED = {
    "not": "'not'", "if": "'if'/'then'/'else'", "then": "'if'/'then'/'else'", "else": "'if'/'then'/'else'",
    "contains": "'contains'", "minContains": "'minContains'", "maxContains": "'maxContains'",
    "dependentRequired": "'dependentRequired'", "dependentSchemas": "'dependentSchemas'",
    "dependencies": "'dependencies'", "patternProperties": "'patternProperties'",
    "propertyNames": "'propertyNames'", "unevaluatedProperties": "'unevaluatedProperties'",
    "unevaluatedItems": "'unevaluatedItems'", "multipleOf": "'multipleOf'",
}
# outlines-core compiles a node by the first of these it finds (then by "type").
_DISPATCH = ("properties", "allOf", "anyOf", "oneOf", "prefixItems", "enum", "const", "$ref")
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_NUMERIC = ("integer", "number")


def schema_to_regex(schema: dict | bool, whitespace_pattern: str | None = None) -> str:
    """The regex of the JSON texts `schema` admits (a subset of them where outlines-core is
    narrower). Raises SchemaError (a schema it cannot compile) with a reason a user can act on."""
    from outlines_core.json_schema import build_regex_from_schema  # here: outlines_core costs start-up time

    if schema is True:
        schema = {}
    if schema is False or not isinstance(schema, dict):
        raise SchemaError("the schema admits no value (false) or is not a JSON object")
    text = json.dumps(schema)
    nonce = secrets.token_hex(6)
    while nonce in text:  # practically never: the placeholders must not occur in the schema itself
        nonce = secrets.token_hex(6)
    rewriter = _Rewriter(f"fwrange{nonce}n")
    work = copy.deepcopy(schema)
    rewriter.visit(work, "#")
    try:
        regex = build_regex_from_schema(json.dumps(work), whitespace_pattern)
    except ValueError as exc:
        raise SchemaError(" ".join(str(exc).split())) from None
    regex = capped_json_numbers(regex)
    for placeholder, range_regex in rewriter.ranges.items():
        regex = regex.replace(f'"{placeholder}"', f"(?:{range_regex})")
    return regex


class _Rewriter:
    """Walks the schema in place: checks each node, swaps bounded numbers for placeholders."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.ranges: dict[str, str] = {}

    def visit(self, node: Any, path: str) -> None:
        if isinstance(node, bool):
            return
        if not isinstance(node, dict):
            raise SchemaError(f"{path}: a schema must be an object or a boolean, got {json.dumps(node)[:60]}")
        self._check(node, path)
        if any(k in node for k in _BOUNDS) and not any(k in node for k in _DISPATCH):
            if self._bounded_number(node, path):
                return
        if isinstance(node.get("pattern"), str) and _types(node) & {"string"}:
            try:
                node["pattern"] = json_string_pattern(node["pattern"])
            except PatternError as exc:
                raise SchemaError(f"{path}/pattern: {exc}") from None
        for key, sub in _subschemas(node):
            self.visit(sub, f"{path}/{key}")

    def _check(self, node: dict, path: str) -> None:
        for key, what in _IGNORED.items():
            if key in node and not (key == "multipleOf" and node[key] in (1, 1.0) and _types(node) <= {"integer"}):
                raise SchemaError(f"{path}: the outlines backend does not enforce {what}; remove it or use the "
                                  "xgrammar backend")
        dispatch = [k for k in _DISPATCH if k in node]
        if len(dispatch) > 1:
            raise SchemaError(f"{path}: the outlines backend compiles only one of {', '.join(dispatch)} in a schema "
                              f"(it would use {dispatch[0]!r} and ignore the rest); nest them with allOf/anyOf or "
                              "use the xgrammar backend")
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            raise SchemaError(f"{path}/allOf: the outlines backend cannot combine several schemas in allOf; merge "
                              "them into one schema")
        if node.get("uniqueItems") is True:
            raise SchemaError(f"{path}: the outlines backend does not enforce 'uniqueItems'; remove it or use the "
                              "xgrammar backend")
        required = node.get("required") or []
        properties = node.get("properties")
        missing = [r for r in required if not isinstance(properties, dict) or r not in properties]
        if missing:
            raise SchemaError(f"{path}: required properties {missing} are not listed in 'properties'; the outlines "
                              "backend only writes listed properties")
        if isinstance(properties, dict) and ("minProperties" in node or "maxProperties" in node):
            raise SchemaError(f"{path}: the outlines backend does not enforce minProperties/maxProperties together "
                              "with 'properties'; use 'required' instead")
        if "string" in _types(node) and ("minLength" in node or "maxLength" in node) and (
                "pattern" in node or "format" in node):
            raise SchemaError(f"{path}: the outlines backend cannot combine minLength/maxLength with a pattern or "
                              "format (it would drop the pattern); put the length into the pattern, e.g. "
                              "'^[a-z]{2,8}$'")
        if (any(k in node for k in _BOUNDS) and not any(k in node for k in _DISPATCH)
                and not _types(node) & set(_NUMERIC)):
            raise SchemaError(f"{path}: numeric bounds need \"type\": \"integer\" or \"number\" in the same schema")

    def _bounded_number(self, node: dict, path: str) -> bool:
        """Replace a bounded integer/number node by a placeholder string the final regex swaps for
        the range (outlines-core pastes a string pattern verbatim). False: not handled here."""
        types = node.get("type")
        if isinstance(types, list):  # ["integer", "null"] with bounds: one branch per type
            if len(types) > 1:
                rest = {k: v for k, v in node.items() if k != "type"}
                node.clear()
                node["anyOf"] = [dict(copy.deepcopy(rest if t in _NUMERIC else _without_bounds(rest)), type=t)
                                 for t in types]
                self.visit(node, path)
                return True
            types = types[0] if types else None
        if types not in _NUMERIC:
            return False
        lo, lo_strict, hi, hi_strict = _bounds(node, path)
        if types == "integer":
            int_lo = None if lo is None else (math.floor(lo) + 1 if lo_strict else math.ceil(lo))
            int_hi = None if hi is None else (math.ceil(hi) - 1 if hi_strict else math.floor(hi))
            regex = int_range(int_lo, int_hi)
        else:
            regex = number_range(lo, hi, lo_strict, hi_strict)
        if regex is None:
            raise SchemaError(f"{path}: the bounds admit no {types}")
        placeholder = f"{self.prefix}{len(self.ranges)}"
        self.ranges[placeholder] = regex
        node.clear()
        node.update({"type": "string", "pattern": placeholder})
        return True


def _without_bounds(node: dict) -> dict:
    return {k: v for k, v in node.items() if k not in _BOUNDS}


def _types(node: dict) -> set[str]:
    t = node.get("type")
    return {t} if isinstance(t, str) else {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()


def _number(value: Any, key: str, path: str) -> Decimal:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SchemaError(f"{path}/{key}: must be a number, got {json.dumps(value)}")
    try:
        result = Decimal(str(value))
    except InvalidOperation:
        raise SchemaError(f"{path}/{key}: {value!r} is not a finite number") from None
    if not result.is_finite():
        raise SchemaError(f"{path}/{key}: {value!r} is not a finite number")
    return result


def _bounds(node: dict, path: str) -> tuple[Decimal | None, bool, Decimal | None, bool]:
    """(lo, lo exclusive, hi, hi exclusive), the stricter where both forms are given (draft 4's
    boolean exclusiveMinimum/Maximum included)."""
    def side(inclusive_key: str, exclusive_key: str, tighter) -> tuple[Decimal | None, bool]:
        value, strict = None, False
        if inclusive_key in node:
            value = _number(node[inclusive_key], inclusive_key, path)
            strict = node.get(exclusive_key) is True
        exclusive = node.get(exclusive_key)
        if exclusive is not None and not isinstance(exclusive, bool):
            candidate = _number(exclusive, exclusive_key, path)
            if value is None or tighter(candidate, value) or candidate == value:
                value, strict = candidate, True
        return value, strict

    lo, lo_strict = side("minimum", "exclusiveMinimum", lambda a, b: a > b)
    hi, hi_strict = side("maximum", "exclusiveMaximum", lambda a, b: a < b)
    return lo, lo_strict, hi, hi_strict


def _subschemas(node: dict):
    """(key path, sub-schema) for every schema nested in `node`."""
    for key in ("properties", "$defs", "definitions"):
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                yield f"{key}/{name}", sub
    for key in ("items", "additionalProperties", "additionalItems"):
        if isinstance(node.get(key), dict):
            yield key, node[key]
    for key in ("items", "prefixItems", "anyOf", "oneOf", "allOf"):
        if isinstance(node.get(key), list):
            for i, sub in enumerate(node[key]):
                yield f"{key}/{i}", sub
