"""Incremental detokenization with stop strings.

Text comes from tokenizers' `DecodeStream`, which holds back bytes until they
form whole UTF-8 characters, so output is never cut mid-character. Stop
strings are searched only in the newly decoded tail, and streaming holds back
any tail that could still grow into a stop string, so a stop string never leaks.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str], skip_special_tokens: bool,
                 include_stop_str_in_output: bool = False):
        self._backend = getattr(tokenizer, "_tokenizer", None) or getattr(tokenizer, "backend_tokenizer")
        # Priming with the prompt's tail makes the first generated token decode in context
        # (leading spaces of SentencePiece-style decoders are kept).
        self._stream = DecodeStream(ids=list(prompt_token_ids[-8:]), skip_special_tokens=skip_special_tokens)
        self.text = ""
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self._hold = max((len(s) for s in stop), default=1) - 1

    def add_token(self, token_id: int, find_stop: bool = True) -> str | None:
        """Decode one token; return the stop string it completed, if any (text is then truncated).

        With find_stop False (before min_tokens) stop strings are not looked for and the text
        stays whole; a stop string completed then does not count later either."""
        piece = self._stream.step(self._backend, token_id)
        if not piece:
            return None
        old_len = len(self.text)
        self.text += piece
        if not self.stop or not find_stop:
            return None
        best = None
        for s in self.stop:
            i = self.text.find(s, max(0, old_len - len(s) + 1))  # occurrences that end in `piece`
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
        return s

    def visible_text(self, finished: bool) -> str:
        """Text safe to show now: all of it once finished, else minus a possible stop-string prefix."""
        if finished or not self._hold:
            return self.text
        for k in range(min(self._hold, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return self.text[:-k]
        return self.text
