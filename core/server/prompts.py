"""Prompts to token ids off the event loop, refused by size before they are tokenized.

Rendering a chat template and tokenizing run on the tokenizer's worker thread: on the event
loop, a 1.9 MB chat message froze every other stream for 3-6 s. A prompt longer in bytes than
--max-input-tokens tokens can cover is refused before it is tokenized, so it costs no tokenizer
time at all. Both prompt-size messages are written here."""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING, Callable

from fw.chat import chat_token_ids
from fw.errors import InvalidRequestError

if TYPE_CHECKING:
    from fw.server.state import ServerState

# Normalizers may shorten text before it is split: NFKC maps some 4-byte characters (U+1D400, a
# bold A) to one byte. The byte bound allows for that, so it never refuses a prompt that fits.
SHRINK = 4


def longest_token_bytes(tokenizer) -> int | None:
    """The most UTF-8 bytes one vocabulary entry spells (added tokens included); None when the
    tokenizer cannot list its vocabulary. Byte-level and SentencePiece entries spell a byte of
    text with one character of up to 3 bytes, so this over-counts, never under-counts."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001 - a tokenizer without a listable vocabulary gets no byte bound
        return None
    return max((len(token.encode("utf-8")) for token in vocab), default=None)


class PromptLimits:
    """--max-input-tokens, and the byte size no prompt within it can exceed. The vocabulary is
    scanned on first use, by `check_bytes` on the tokenizer's thread: not at start-up, not on the loop."""

    def __init__(self, max_tokens: int, tokenizer):
        self.max_tokens = max_tokens
        self._tokenizer = tokenizer

    @cached_property
    def longest_token(self) -> int | None:
        return longest_token_bytes(self._tokenizer)

    @cached_property
    def max_bytes(self) -> int | None:
        return None if self.longest_token is None else self.max_tokens * self.longest_token * SHRINK

    def check_bytes(self, text: str, param: str) -> None:
        if self.max_bytes is None or len(text) * 4 <= self.max_bytes:  # UTF-8: at most 4 bytes a character
            return
        size = len(text.encode("utf-8"))
        if size > self.max_bytes:
            raise InvalidRequestError(
                f"the prompt has {size} bytes, more than {self.max_tokens} tokens can hold: this server "
                f"takes at most {self.max_tokens} tokens (--max-input-tokens), and no prompt over "
                f"{self.max_bytes} bytes fits in that ({self.longest_token} bytes in its longest token, "
                f"x{SHRINK} for normalization); shorten it", param=param)

    def check_tokens(self, num_tokens: int, param: str = "prompt") -> None:
        if num_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"the prompt has {num_tokens} tokens, more than the {self.max_tokens} this server accepts "
                f"(--max-input-tokens); shorten it", param=param)


async def text_prompt_ids(state: ServerState, text: str) -> list[int]:
    """A completion's text prompt: its size checked, then tokenized off the event loop."""
    limits = state.prompt_limits

    def work() -> list[int]:
        limits.check_bytes(text, "prompt")
        return state.tokenizer(text).input_ids

    return await state.engine.in_tokenizer_thread(work)


async def chat_prompt(state: ServerState, render: Callable[[], str]) -> tuple[str, list[int]]:
    """A chat prompt: `render` (the template) run, its size checked and the text tokenized, all
    off the event loop. Returns (text, ids)."""
    limits = state.prompt_limits

    def work() -> tuple[str, list[int]]:
        text = render()
        limits.check_bytes(text, "messages")
        return text, chat_token_ids(state.tokenizer, text)

    return await state.engine.in_tokenizer_thread(work)
