"""Text from a request, made safe to log.

A request chooses its field names, paths and values; written raw, a newline in one starts a line
of the requester's making in the log (a forged entry), and terminal escapes repaint an operator's
screen. repr() escapes both, and its quotes show where the request's text starts and ends."""

from __future__ import annotations

from typing import Iterable


def quoted(text: object) -> str:
    """One request-derived value for a log line: repr of its text, control characters escaped."""
    return repr(str(text))


def quoted_all(items: Iterable[object]) -> str:
    """Several request-derived values, comma-separated, each `quoted`."""
    return ", ".join(quoted(item) for item in items)
