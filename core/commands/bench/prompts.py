"""Synthetic prompts of a requested approximate token length, without a tokenizer.

The load generator has to work against any server, so it cannot assume it has
the server's tokenizer. A prompt is a seeded random sequence of common English
words; its length in words is the target token count divided by a
tokens-per-word ratio. The ratio is 1.3 (typical for English under BPE
tokenizers) unless the server offers vLLM's `POST /tokenize`, in which case it
is measured once on text from the same word list (see `calibrate`).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import httpx

# Common words, mostly one token in BPE vocabularies. Sampled at random so that
# prompts share no long prefix: a prefix cache must not make the benchmark look faster.
WORDS: tuple[str, ...] = tuple("""
the of and to in is that it was for on are as with his they at be this from have or by one had not
but what all were when we there can an your which their said if do will each about how up out them
then she many some so these would other into has more her two like him see time could no make than
first been its who now people my made over did down only way find use may water long little very
after words called just where most know get through back much go good new write our used me man too
any day same right look think also around another came come work three word must because does part
even place well such here take why things help put years different away again off went old number
great tell men say small every found still between name should home big give air line set own under
read last never us left end along while might next sound below saw something thought both few those
always looked show large often together asked house world going want school important until form food
keep children feet land side without boy once animals life enough took sometimes four head above kind
began almost live page got earth need far hand high year mother light parts country father let night
following picture being study second eyes soon times story boys since white days ever paper hard near
sentence better best across during today others however sure means knew try told young miles sun ways
""".split())

DEFAULT_TOKENS_PER_WORD = 1.3


def sample_lengths(mean: int, range_ratio: float, n: int, rng: random.Random) -> list[int]:
    """`n` lengths uniform over the integers in [mean*(1-r), mean*(1+r)], at least 1.

    A spread of lengths is what real traffic looks like; `range_ratio=0` gives the
    fixed length that makes runs comparable. The same bounds as vLLM's random
    dataset, so `--input-len 128 --input-len-range 0.5` means [64, 192] in both.
    """
    if mean < 1:
        raise ValueError(f"length must be at least 1, got {mean}")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"length range must be in [0, 1), got {range_ratio}")
    low = max(1, math.floor(mean * (1 - range_ratio)))
    high = max(low, math.ceil(mean * (1 + range_ratio)))
    return [rng.randint(low, high) for _ in range(n)]


def words_for_tokens(tokens: int, tokens_per_word: float) -> int:
    """How many words make about `tokens` tokens."""
    return max(1, round(tokens / tokens_per_word))


def make_prompt(num_words: int, rng: random.Random) -> str:
    """`num_words` words from WORDS, drawn with `rng` (so a seed reproduces the whole run)."""
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


@dataclass(frozen=True)
class Calibration:
    """Tokens per word and where the figure came from ("tokenize" or "default")."""

    tokens_per_word: float
    source: str


def calibration_from_counts(words_a: int, count_a: int, words_b: int, count_b: int) -> float | None:
    """Tokens per word from two tokenizations of texts where one extends the other.

    Taking the difference cancels what the server adds once per prompt (a BOS
    token, a chat template), which would otherwise inflate the ratio for short
    texts. None when the figures make no sense (then the default is used).
    """
    if words_b <= words_a:
        return None
    ratio = (count_b - count_a) / (words_b - words_a)
    return ratio if 0.2 <= ratio <= 20 else None


async def calibrate(client: httpx.AsyncClient, tokenize_url: str, model: str, headers: dict[str, str],
                    seed: int) -> Calibration:
    """Measure tokens per word with the server's `POST /tokenize`, or fall back to 1.3 silently.

    `/tokenize` is a vLLM extension that fw also serves; TGI, SGLang and OpenAI
    do not have it (or have it elsewhere), so any failure, 404 included, just
    means the default ratio. Two texts, 200 and 400 words, with the second
    extending the first.
    """
    rng = random.Random(seed ^ 0x5EED)
    text = make_prompt(400, rng).split(" ")
    counts = []
    for n in (200, 400):
        try:
            resp = await client.post(tokenize_url, json={"model": model, "prompt": " ".join(text[:n])},
                                     headers=headers)
            if resp.status_code != 200:
                return Calibration(DEFAULT_TOKENS_PER_WORD, "default")
            body = resp.json()
            count = body.get("count")
            counts.append(int(count) if count is not None else len(body["tokens"]))
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
            return Calibration(DEFAULT_TOKENS_PER_WORD, "default")
    ratio = calibration_from_counts(200, counts[0], 400, counts[1])
    if ratio is None:
        return Calibration(DEFAULT_TOKENS_PER_WORD, "default")
    return Calibration(ratio, "tokenize")
