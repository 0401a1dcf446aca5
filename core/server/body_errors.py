"""Why a request body could not be read, in words that name the cause.

FastAPI reports every body it cannot parse as "There was an error parsing the body", and a body
sent as text/plain or a form as a type error; the client learns nothing. These messages name the
cause: the Content-Type, bytes that are not UTF-8, an integer too long to convert, JSON nested
too deeply, a body that is not a JSON object."""

from __future__ import annotations

import email.message
import re
import sys
from typing import Any

SEND_JSON = "send a JSON object with Content-Type: application/json"


def is_json(content_type: str | None) -> bool:
    """application/json or application/*+json, parameters (charset) aside."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def wrong_content_type(content_type: str | None) -> str:
    if not content_type:
        return f"the request has no Content-Type header, so its body was not read as JSON; {SEND_JSON}"
    hint = " (curl -d sends this unless told otherwise)" if "x-www-form-urlencoded" in content_type else ""
    return f"the request's Content-Type is {content_type!r}{hint}, not JSON; {SEND_JSON}"


def unreadable(cause: BaseException | None) -> str:
    """The message for a body the JSON parser raised `cause` on (not a syntax error: those carry
    their own position and are reported as such)."""
    if isinstance(cause, UnicodeDecodeError):
        return (f"the request body is not UTF-8 text: byte 0x{cause.object[cause.start]:02x} at offset "
                f"{cause.start} ({cause.reason}); send UTF-8 encoded JSON")
    if isinstance(cause, RecursionError):
        return (f"the request body's JSON nests arrays or objects too deeply (more than about "
                f"{sys.getrecursionlimit()} levels); flatten it")
    if isinstance(cause, ValueError) and "integer string conversion" in str(cause):
        found = re.search(r"value has (\d+) digits", str(cause))
        digits = f"{found.group(1)} digits" if found else "too many digits"
        return (f"the request body has an integer with {digits}; integers may have at most "
                f"{sys.get_int_max_str_digits()} digits")
    detail = f": {type(cause).__name__}: {cause}" if cause is not None else ""
    return f"the request body could not be read as JSON{detail}"


def not_an_object(value: Any) -> str:
    kind = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
            type(None): "null", bytes: "bytes"}.get(type(value), type(value).__name__)
    return f"the request body must be a JSON object, got {kind}; {SEND_JSON}"
