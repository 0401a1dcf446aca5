"""A JSON schema checked against its metaschema with the `jsonschema` library, so
a malformed schema (from response_format, guided_json or a tool's parameters)
is refused up front with the keyword's path, the same way whichever grammar
backend would have compiled it. What a backend cannot compile from a valid
schema is its own error, later."""

from __future__ import annotations

from typing import Any

import jsonschema
from jsonschema.validators import validator_for

from fw.errors import InvalidRequestError


def check_json_schema(schema: Any, where: str, param: str) -> None:
    """Raise InvalidRequestError naming `where` + the offending keyword's path. The draft is the
    schema's `$schema`, else 2020-12."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{where}: a JSON schema must be an object, got {type(schema).__name__}",
                                  param=param)
    try:
        validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except RecursionError:  # the metaschema check recurses per nesting level
        raise InvalidRequestError(f"{where}: the JSON schema nests too deeply to check; flatten it (use $defs "
                                  f"and $ref for repeated parts)", param=param) from None
    except jsonschema.SchemaError as exc:
        at = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in exc.absolute_path)
        raise InvalidRequestError(f"{where}{at}: not a valid JSON Schema: {exc.message}", param=param) from None
