"""Chat templates rendered with jinja2 the way transformers renders them, without importing transformers.

Why: importing transformers costs a second or more per process, and fw's serving path needs only
the rendering. This module mirrors transformers 5's `render_jinja_template` for what fw's routes
use (messages, tools as JSON schemas, documents, add_generation_prompt, extra template variables):
the same sandboxed environment (trim_blocks, lstrip_blocks, loop controls, the `generation` tag),
the same `tojson`, `raise_exception`, `strftime_now`, `dict` and `namespace`, and the same
clean-up of the inputs (None-valued message keys dropped, everything rebuilt from plain JSON
types, reasoning fields aliased). transformers stays the oracle: tests/test_fast_tokenizer.py
renders a corpus of conversations both ways. Anything else (callables as tools, a final message
to continue, assistant masks, control-token sanitizing) goes to transformers itself
(`FastTokenizer.apply_chat_template`)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from fw.errors import ConfigError

# Names a message's reasoning is passed under; the first is the one templates read (as transformers).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (templates that mark assistant text for training
    masks): rendered as its body, as transformers does when it is not tracking the mask."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


class _TemplateDict:
    """`dict(...)` inside a template, without handing it the dict type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's namespace refusing underscore-prefixed names (no way into CPython internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                "Please rename the attribute.")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                       namespace=_TemplateNamespace)
    return env.from_string(source)


def plain_data(value: Any) -> Any:
    """`value` rebuilt from plain JSON types (what a sandboxed template may see); other objects become
    an inert "<TypeName>" placeholder."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_data(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain_data(v) for v in value)
    if type(value).__module__ == "numpy" and hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        return plain_data(value.item())  # a numpy scalar
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return plain_data(value.model_dump())
    return f"<{type(value).__name__}>"


def _as_dicts(value: Any) -> Any:
    """Message objects (dataclasses, pydantic models such as the OpenAI SDK's) as dicts."""
    if isinstance(value, Mapping):
        return {k: _as_dicts(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_dicts(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_as_dicts(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _as_dicts(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _as_dicts(value.model_dump())
    return value


def normalize_messages(messages: Any) -> list[dict]:
    """Messages as dicts without None-valued keys (an OpenAI client's `content=None`, `tool_calls=None`)."""
    out = []
    for message in _as_dicts(getattr(messages, "messages", messages)):
        if not isinstance(message, dict):
            raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got {message!r}.")
        out.append({k: v for k, v in message.items() if v is not None})
    return out


def _alias_reasoning(chat: list[dict]) -> list[dict]:
    out = []
    for message in chat:
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def render(template: str, messages: Any, *, tools: list[dict] | None = None, documents: list[dict] | None = None,
           add_generation_prompt: bool = False, **variables: Any) -> str:
    """One conversation rendered by `template`; `variables` (the tokenizer's special tokens and the
    caller's chat_template_kwargs) are visible to the template by name."""
    if documents is not None and any(not isinstance(d, dict) for d in documents):
        raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    chat = _alias_reasoning(plain_data(normalize_messages(messages)))
    return compile_template(template).render(
        messages=chat, tools=plain_data(tools), documents=plain_data(documents),
        add_generation_prompt=add_generation_prompt, **plain_data(variables))


# vLLM's rule: a value holding none of these characters is meant as a file's path
_TEMPLATE_CHARS = "{}\n"


def load_chat_template(value: str, flag: str = "--chat-template") -> str:
    """The template text `value` names (vLLM's and MAX's --chat-template): a file's contents, or `value`
    itself with its backslash escapes read (a shell passes `\\n` as two characters); parsed once here so
    that a broken template fails at start-up. ConfigError names `flag` and what to fix."""
    path = os.path.expanduser(value)
    if os.path.isfile(path):
        try:
            text = open(path, encoding="utf-8").read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{flag} {value}: cannot read the file ({exc})") from None
        where = f"{flag} {value}"
    elif not any(c in value for c in _TEMPLATE_CHARS):
        raise ConfigError(f"{flag} {value}: no such file. Give a Jinja template file, or the template itself "
                          "(text with {{ }} or {% %})")
    else:
        # latin-1 with backslashreplace keeps every other character as it is through unicode_escape
        text = value.encode("latin-1", "backslashreplace").decode("unicode_escape")
        where = f"{flag} (the template given inline)"
    if not text.strip():
        raise ConfigError(f"{where}: the template is empty")
    try:
        compile_template(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"{where}: not a valid Jinja template: {exc.message} (line {exc.lineno})") from None
    return text
