"""Server-sent events from OpenAI-compatible streams: bytes to `data:` payloads
(`SSEDecoder`) and payloads to what they say (`parse_chunk`)."""

from __future__ import annotations

import codecs
import json
import re
from dataclasses import dataclass


class SSEDecoder:
    """Incremental server-sent-events decoder: network chunks in, `data:` payloads out.

    Chunks split lines (and UTF-8 sequences) anywhere, so both are carried over
    to the next feed. Each `data:` line is one payload: every OpenAI-compatible
    server sends one JSON object per line, and dispatching per line (instead of
    waiting for the blank line that ends an event) stamps each payload with the
    time its own bytes arrived. Comments (`:`), `event:`, `id:`, `retry:` and
    blank lines carry no tokens and are skipped.
    """

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buffer = ""

    def feed(self, chunk: bytes) -> list[str]:
        text = self._buffer + self._utf8.decode(chunk)
        held = text.endswith("\r")  # may be the first half of \r\n: decide with the next chunk
        lines = _LINE_BREAK.split(text[:-1] if held else text)
        self._buffer = lines.pop() + ("\r" if held else "")
        return [p for p in map(_data_payload, lines) if p is not None]

    def flush(self) -> list[str]:
        """Whatever is left when the stream closes without a final newline."""
        rest = self._buffer + self._utf8.decode(b"", final=True)
        self._buffer = ""
        payload = _data_payload(rest.rstrip("\r"))
        return [] if payload is None else [payload]


_LINE_BREAK = re.compile(r"\r\n|\r|\n")


def _data_payload(line: str) -> str | None:
    if not line.startswith("data:"):
        return None
    payload = line[len("data:"):]
    return payload[1:] if payload.startswith(" ") else payload


@dataclass
class Chunk:
    """What one streamed payload says."""

    text: str = ""
    done: bool = False
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None


def parse_chunk(payload: str) -> Chunk:
    """One `data:` payload of a completions or chat-completions stream.

    Content is `choices[].text` (completions) or `choices[].delta.content`
    (chat); reasoning text (`reasoning_content`, `reasoning`) counts as content
    because the server spent tokens on it. An `error` object (vLLM and TGI
    report mid-stream failures that way) makes the chunk an error. Raises
    ValueError on a payload that is not a JSON object.
    """
    if payload.strip() == "[DONE]":
        return Chunk(done=True)
    obj = json.loads(payload)
    if not isinstance(obj, dict):
        raise ValueError(f"stream payload is not a JSON object: {payload[:200]!r}")
    chunk = Chunk()
    if obj.get("error"):
        err = obj["error"]
        chunk.error = str(err.get("message", err)) if isinstance(err, dict) else str(err)
        return chunk
    for choice in obj.get("choices") or []:
        delta = choice.get("delta")
        if isinstance(delta, dict):
            for key in ("reasoning_content", "reasoning", "content"):
                if isinstance(delta.get(key), str):
                    chunk.text += delta[key]
        elif isinstance(choice.get("text"), str):
            chunk.text += choice["text"]
        chunk.finish_reason = choice.get("finish_reason") or chunk.finish_reason
    usage = obj.get("usage")
    if isinstance(usage, dict):
        chunk.completion_tokens = usage.get("completion_tokens")
        chunk.prompt_tokens = usage.get("prompt_tokens")
    return chunk
