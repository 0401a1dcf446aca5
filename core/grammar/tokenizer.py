"""The tokenizer as grammar backends need it: each token id's raw bytes, the
stop tokens, and the logits width.

Backends match text, while a vocabulary stores tokens in the tokenizer's own
spelling (GPT-2's byte-to-unicode map for byte-level BPE; '▁' and <0xNN>
byte-fallback pieces for SentencePiece-style ones). `token_bytes()` undoes that
once per engine, so every backend sees the same bytes."""

from __future__ import annotations

import hashlib
import json
import threading
from functools import lru_cache
from typing import Any


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's reversible byte <-> printable-unicode map, inverted (unicode char -> byte)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class GrammarTokenizer:
    """What `GrammarBackendSpec.factory` receives.

    hf_tokenizer: the engine's transformers tokenizer; vocab_size: the model's logits width (may
    exceed the tokenizer's vocabulary: the extra ids are never allowed); eos_token_ids: every token
    that ends a sequence (a grammar in an accepting state allows these)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]):
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self._lock = threading.Lock()
        self._token_bytes: list[bytes | None] | None = None

    @property
    def eos_token_id(self) -> int:
        """One stop token for backends that take a single one: the tokenizer's own EOS if it is a stop token."""
        own = getattr(self.hf_tokenizer, "eos_token_id", None)
        return own if own in self.eos_token_ids else min(self.eos_token_ids)

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Control tokens: never produced by a grammar (stop tokens are handled separately)."""
        tok = self.hf_tokenizer
        ids = set(getattr(tok, "all_special_ids", []) or [])
        for token_id, added in (getattr(tok, "added_tokens_decoder", None) or {}).items():
            if getattr(added, "special", False):
                ids.add(int(token_id))
        return frozenset(ids)

    def token_bytes(self) -> list[bytes | None]:
        """Per token id below `vocab_size`: the bytes it contributes to text, or None for special
        tokens and ids the tokenizer lacks. Computed once (about 0.1 s for 50k tokens)."""
        with self._lock:
            if self._token_bytes is None:
                self._token_bytes = self._compute_token_bytes()
            return self._token_bytes

    def _compute_token_bytes(self) -> list[bytes | None]:
        tok = self.hf_tokenizer
        vocab: dict[str, int] = tok.get_vocab()
        spelling = self._spelling()
        special = self.special_token_ids
        out: list[bytes | None] = [None] * self.vocab_size
        byte_map = _byte_level_decoder()
        for piece, token_id in vocab.items():
            if not 0 <= token_id < self.vocab_size or token_id in special:
                continue
            if spelling == "byte_level":
                try:
                    out[token_id] = bytes(byte_map[c] for c in piece)
                except KeyError:  # an added, non-byte-level token: its text as written
                    out[token_id] = piece.encode("utf-8")
            elif spelling == "metaspace":
                if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                    out[token_id] = bytes([int(piece[3:5], 16)])
                else:
                    out[token_id] = piece.replace("\u2581", " ").encode("utf-8")
            else:
                out[token_id] = tok.convert_tokens_to_string([piece]).encode("utf-8")
        return out

    def _spelling(self) -> str:
        """'byte_level', 'metaspace' or 'plain', from the fast tokenizer's decoder."""
        backend = getattr(self.hf_tokenizer, "backend_tokenizer", None)
        if backend is None:
            return "plain"
        decoder = json.loads(backend.to_str()).get("decoder") or {}
        kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders", []) or []}
        if "ByteLevel" in kinds:
            return "byte_level"
        if "Metaspace" in kinds or "ByteFallback" in kinds or "Replace" in kinds:
            return "metaspace"
        return "plain"

    @property
    def cache_key(self) -> str:
        """Identifies the vocabulary (for caches of compiled grammars kept across processes)."""
        vocab = sorted(self.hf_tokenizer.get_vocab().items(), key=lambda kv: kv[1])
        digest = hashlib.sha256(json.dumps([vocab, self.vocab_size, sorted(self.eos_token_ids)]).encode())
        return digest.hexdigest()[:16]
