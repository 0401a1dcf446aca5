"""The built-in `ngram` proposer: prompt lookup decoding (Saxena 2023; vLLM's `ngram` method).

The last n tokens of a sequence (prompt and output so far) are looked up earlier in the same sequence,
for n from `prompt_lookup_max` down to `prompt_lookup_min`; at the longest n that matches, the tokens that
followed its most recent earlier occurrence are the draft (up to k of them). Nothing matches: no draft,
and the step is a plain decode. Deterministic (no draft probabilities) and stateless: it needs no model and
costs a vectorised scan of the sequence per step. It pays off where outputs copy from their context
(editing code, extracting or repeating passages, and the loops small models fall into).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from fw.plugins import ProposerSpec, hookimpl
from fw.speculative import Draft, DraftRequest, ProposerContext

FW_PLUGIN_API_VERSION = "1.3"

PARAMETERS = {
    "type": "object",
    "properties": {
        "prompt_lookup_min": {"type": "integer", "minimum": 1,
                              "description": "shortest n-gram matched (default: prompt_lookup_max when only it "
                                             "is given, else 2)"},
        "prompt_lookup_max": {"type": "integer", "minimum": 1,
                              "description": "longest n-gram matched, tried first (default: prompt_lookup_min "
                                             "when only it is given, else 5)"},
    },
    "additionalProperties": False,
}
DEFAULT_MIN, DEFAULT_MAX = 2, 5


def lookup(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """The draft for `tokens`: up to k tokens after the most recent earlier occurrence of its longest
    suffix of n_min..n_max tokens that occurs earlier; [] when none does."""
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        # windows starting at 0 .. length-n-1: every occurrence that ends before the last token
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []


class NgramProposer:
    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft | None]:
        out: list[Draft | None] = []
        for request in requests:
            tokens = np.fromiter(request.token_ids, dtype=np.int64, count=len(request.token_ids))
            ids = lookup(tokens, self.n_min, self.n_max, request.max_tokens)
            out.append(Draft(ids) if ids else None)
        return out

    def release(self, seq_id: int) -> None:
        pass


def build(args: dict, context: ProposerContext) -> NgramProposer:
    """vLLM's defaults rule: one bound given, the other takes its value."""
    lo, hi = args.get("prompt_lookup_min"), args.get("prompt_lookup_max")
    if lo is None and hi is None:
        lo, hi = DEFAULT_MIN, DEFAULT_MAX
    lo = hi if lo is None else lo
    hi = lo if hi is None else hi
    if lo > hi:
        raise ValueError(f"prompt_lookup_min ({lo}) is above prompt_lookup_max ({hi})")
    return NgramProposer(lo, hi)


@hookimpl
def fw_register_proposers(register) -> None:
    register(ProposerSpec("ngram", build, parameters=PARAMETERS,
                          description="prompt lookup: drafts what followed the latest earlier match of the "
                                      "sequence's last n tokens"))
