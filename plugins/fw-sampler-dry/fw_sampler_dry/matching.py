"""DRY's sequence matching over token-id lists, following llama.cpp's `llama_sampler_dry`
(ported there from koboldcpp) so that the same parameters penalise the same tokens.

For the context's last token, every earlier occurrence is a candidate: the match length is how
far the tokens before it agree with the tokens before the end (the longest repeated suffix
ending there). The token that followed that occurrence would extend the repeat, so it is the
one penalised, by ``multiplier * base ** (length - allowed_length)`` once the length reaches
`allowed_length`. A repeat never reaches back past a sequence breaker, and a token that is a
breaker by itself is never penalised.

The scan is plain Python over lists: finding candidates is `list.index` (a C loop) and each
candidate costs its match length, capped where the penalty stops growing (llama.cpp clamps the
exponent so the penalty stays a finite float32), so a step costs O(window + matched tokens); a
candidate whose next token already has the longest possible match is skipped, which keeps a
degenerate loop (the case DRY is for) from costing window x cap.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Mapping, Sequence

FLOAT_MAX_LOG = 88.7228391  # ln(float32 max): llama.cpp's clamp of the penalty's exponent
FLOAT32_MAX = 3.4028234663852886e38


@dataclass(frozen=True)
class Breakers:
    """Sequence breakers as token sequences: `heads` maps a breaker's first token to the tails
    that complete it (the tokens after the head; ``()`` when the head token is a breaker by itself,
    e.g. a token whose text contains "\\n")."""

    heads: Mapping[int, tuple[tuple[int, ...], ...]] = field(default_factory=dict)

    @property
    def single(self) -> frozenset[int]:
        """Tokens that are breakers on their own: never penalised."""
        return frozenset(t for t, tails in self.heads.items() if () in tails)


NO_BREAKERS = Breakers()


def restart_limit(window: Sequence[int], breakers: Breakers) -> int:
    """How many trailing tokens of `window` come after its last complete breaker (all of them
    when it has none): no repeat may reach back past a breaker."""
    n = len(window)
    heads = breakers.heads
    if not heads:
        return n
    for i in range(n):  # i tokens from the end
        tails = heads.get(window[n - 1 - i])
        if tails is None:
            continue
        longest = -1
        for tail in tails:  # a breaker's tail follows its head, toward the end of the window
            m = len(tail)
            if longest < m <= i and all(tail[o] == window[n - i + o] for o in range(m)):
                longest = m
        if longest >= 0:
            return i - longest
    return n


def max_exponent(base: float) -> int:
    """The exponent beyond which ``base ** exponent`` would overflow float32 (0: no clamp)."""
    return int(FLOAT_MAX_LOG / math.log(base)) if base > 1.000001 else 0


def length_limit(base: float, allowed_length: int) -> int:
    """The match length past which the penalty no longer grows, so matching can stop there."""
    clamp = max_exponent(base)
    if clamp > 0:
        return allowed_length + clamp
    return allowed_length if base == 1.0 else sys.maxsize


def penalty(length: int, multiplier: float, base: float, allowed_length: int) -> float:
    """What DRY subtracts from the logit of a token that would extend a repeat of `length` tokens."""
    exponent = length - allowed_length
    clamp = max_exponent(base)
    if clamp > 0:
        exponent = min(exponent, clamp)
    return min(multiplier * base ** exponent, FLOAT32_MAX)


def repeat_lengths(tokens: Sequence[int], allowed_length: int, last_n: int = -1,
                   breakers: Breakers = NO_BREAKERS, limit: int = sys.maxsize) -> dict[int, int]:
    """For each token that would extend a repeat of at least `allowed_length` tokens, the longest
    such repeat (capped at `limit`). `last_n`: only the last N tokens count (-1: all, 0: none)."""
    if last_n == 0:
        return {}
    window = tokens[-last_n:] if 0 < last_n < len(tokens) else tokens  # read only: no copy of the history
    n = len(window)
    if n <= allowed_length:
        return {}
    cap = min(restart_limit(window, breakers), limit)
    if cap < allowed_length:
        return {}
    end = n - 1
    last = window[end]
    found: dict[int, int] = {}
    index = window.index
    i = -1
    while True:
        try:
            i = index(last, i + 1, end)  # the next earlier occurrence of the last token
        except ValueError:
            break
        if found.get(window[i + 1], 0) >= cap:  # that token already has the longest match possible
            continue
        k = 1
        while k < cap and k <= i and window[i - k] == window[end - k]:
            k += 1
        if k >= allowed_length:
            token = window[i + 1]
            if found.get(token, 0) < k:
                found[token] = k
    return found
