"""A function's `parameters`: a valid JSON Schema (checked by fw.grammar.schema_check with the
`jsonschema` library) of an object. What a grammar backend cannot compile is caught later, by the
backend, with its own reason."""

from __future__ import annotations

from typing import Any

from fw.errors import InvalidRequestError
from fw.grammar.schema_check import check_json_schema


def check_parameters_schema(schema: Any, where: str) -> None:
    check_json_schema(schema, where, param="tools")
    if isinstance(schema, dict) and schema.get("type", "object") != "object":
        raise InvalidRequestError(f'{where}.type: the arguments are a JSON object: use "type": "object", '
                                  f"not {schema['type']!r}", param="tools")
