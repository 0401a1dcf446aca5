"""What a request constrains its output to, in one canonical, hashable form.

`StructuredOutputsParams` is the user-facing shape (vLLM's name and fields);
`Constraint` is what backends compile and what the compile cache is keyed by:
a JSON schema is stored as compact JSON text in its declared key order, since
backends emit properties in that order (a "reasoning" field declared before
"answer" must come first), so equal schemas written alike share one compile."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from fw.errors import InvalidRequestError
from fw.grammar.schema_check import check_json_schema

ConstraintKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
CONSTRAINT_KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class Constraint:
    """One compiled-grammar input. `value`: compact JSON text (json_schema), the pattern (regex),
    the options (choice), the EBNF/Lark text (grammar), or None (json_object: any JSON object)."""

    kind: ConstraintKind
    value: str | tuple[str, ...] | None = None

    @property
    def schema(self) -> dict | bool:
        """The JSON schema of a json_schema constraint, parsed."""
        if self.kind != "json_schema":
            raise TypeError(f"a {self.kind} constraint has no JSON schema")
        return json.loads(self.value)

    def describe(self, limit: int = 80) -> str:
        """A short human description for logs and error messages."""
        text = self.value if isinstance(self.value, str) else json.dumps(self.value)
        if text is not None and len(text) > limit:
            text = text[:limit - 3] + "..."
        return self.kind if text is None else f"{self.kind} {text}"


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output; set exactly one of `json`, `regex`, `choice`, `grammar`,
    `json_object`. `backend` names a grammar backend for this request (default: the engine's)."""

    json: dict | bool | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    backend: str | None = None

    def __post_init__(self) -> None:
        set_fields = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            set_fields.append("json_object")
        if len(set_fields) != 1:
            raise InvalidRequestError(
                "structured output takes exactly one of json (a JSON schema), regex, choice, grammar or "
                f"json_object; got {', '.join(set_fields) or 'none'}", param="structured_outputs")
        self._constraint = _to_constraint(self)

    def constraint(self) -> Constraint:
        return self._constraint


def _to_constraint(p: StructuredOutputsParams) -> Constraint:
    def bad(param: str, why: str) -> InvalidRequestError:
        return InvalidRequestError(f"{param}: {why}", param=param)

    if p.json is not None:
        schema: Any = p.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise bad("json", f"the JSON schema is not valid JSON ({exc})") from None
        check_json_schema(schema, "json", param="json")
        return Constraint("json_schema", json.dumps(schema, separators=(",", ":")))
    if p.regex is not None:
        if not isinstance(p.regex, str) or not p.regex:
            raise bad("regex", "must be a non-empty string")
        return Constraint("regex", p.regex)
    if p.choice is not None:
        if (not isinstance(p.choice, (list, tuple)) or not p.choice
                or not all(isinstance(c, str) and c for c in p.choice)):
            raise bad("choice", "must be a non-empty list of non-empty strings")
        return Constraint("choice", tuple(p.choice))
    if p.grammar is not None:
        if not isinstance(p.grammar, str) or not p.grammar.strip():
            raise bad("grammar", "must be a non-empty grammar text (EBNF or Lark)")
        return Constraint("grammar", p.grammar)
    return Constraint("json_object")
