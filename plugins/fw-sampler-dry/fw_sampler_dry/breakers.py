"""Sequence breakers from strings, as llama.cpp (after koboldcpp) makes them: a breaker string
matches inside tokens, not only as a token of its own.

Every token whose text contains the string is a breaker by itself ("\\n" breaks at ".\\n\\n"
too). A token whose text ends with the start of the string is the head of a longer breaker,
completed by the tokenization of the rest of the string (at most 20 tokens). Building this scans
the vocabulary's texts, so the texts are decoded once per tokenizer and each string's breakers
are kept."""

from __future__ import annotations

from typing import Any, Iterable

from fw_sampler_dry.matching import Breakers

MAX_TAIL_TOKENS = 20


class BreakerTable:
    """One tokenizer's token texts and the breakers built from them, by string."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._texts: list[str] | None = None
        self._by_string: dict[str, list[tuple[int, tuple[int, ...]]]] = {}
        self._by_list: dict[tuple[str, ...], Breakers] = {}

    def texts(self) -> list[str]:
        """Each token's text, special tokens included. A transformers fast tokenizer's backend
        decodes the vocabulary in one call (about 0.1 s for 49k tokens; its wrapper takes 0.6 s)."""
        if self._texts is None:
            tok = self.tokenizer
            ids = [[i] for i in range(len(tok))]
            backend = getattr(tok, "backend_tokenizer", None)
            if backend is not None:
                self._texts = list(backend.decode_batch(ids, skip_special_tokens=False))
            elif hasattr(tok, "batch_decode"):
                self._texts = list(tok.batch_decode(ids, skip_special_tokens=False))
            else:
                self._texts = [tok.decode(i, skip_special_tokens=False) for i in ids]
        return self._texts

    def breakers(self, strings: Iterable[str]) -> Breakers:
        key = tuple(strings)
        found = self._by_list.get(key)
        if found is None:
            heads: dict[int, list[tuple[int, ...]]] = {}
            for s in key:
                for head, tail in self._entries(s):
                    if tail not in heads.setdefault(head, []):
                        heads[head].append(tail)
            found = Breakers({h: tuple(tails) for h, tails in heads.items()})
            if len(self._by_list) >= 256:  # requests may each send their own lists
                self._by_list.clear()
            self._by_list[key] = found
        return found

    def _entries(self, s: str) -> list[tuple[int, tuple[int, ...]]]:
        entries = self._by_string.get(s)
        if entries is not None:
            return entries
        entries = []
        first = s[0]
        tails: dict[str, tuple[int, ...]] = {}
        for token, word in enumerate(self.texts()):
            if first not in word:
                continue
            if s in word:
                entries.append((token, ()))
                continue
            pos = word.find(first)
            while pos != -1:
                rest = word[pos:]
                if s.startswith(rest):  # the token ends with the start of the breaker
                    remainder = s[len(rest):]
                    if remainder not in tails:
                        ids = self.tokenizer.encode(remainder, add_special_tokens=False)
                        tails[remainder] = tuple(ids[:MAX_TAIL_TOKENS])
                    if (token, tails[remainder]) not in entries:
                        entries.append((token, tails[remainder]))
                pos = word.find(first, pos + 1)
        self._by_string[s] = entries
        return entries
