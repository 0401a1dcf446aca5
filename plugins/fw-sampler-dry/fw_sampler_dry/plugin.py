"""The fw plugin module: DRY ("Don't Repeat Yourself") as a per-request sampler stage.

A request names it with its parameters::

    SamplingParams(samplers=[{"name": "dry", "multiplier": 0.8, "allowed_length": 2}])
    # on the server: extra_body={"samplers": [{"name": "dry", "multiplier": 0.8}]}

Rows that do not name it are not touched. It runs after the built-in penalties and before
temperature (order 35), as in llama.cpp's sampler chain."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from fw.plugins import SamplerSpec, hookimpl
from fw.sampling.batch import SamplingBatch
from fw_sampler_dry.breakers import BreakerTable
from fw_sampler_dry.matching import NO_BREAKERS, Breakers, length_limit, penalty, repeat_lengths

FW_PLUGIN_API_VERSION = "1.0"

# Defaults: the values the DRY author recommends (multiplier 0.8, base 1.75, allowed length 2) and
# llama.cpp's default breakers; penalty_last_n -1 scans the whole sequence, prompt included.
PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "multiplier": {"type": "number", "minimum": 0, "default": 0.8,
                       "description": "penalty scale; 0 turns DRY off"},
        "base": {"type": "number", "minimum": 1, "default": 1.75,
                 "description": "growth of the penalty per token of repeat beyond allowed_length"},
        "allowed_length": {"type": "integer", "minimum": 1, "default": 2,
                           "description": "repeats shorter than this are not penalised"},
        "sequence_breakers": {"type": "array", "maxItems": 64, "default": ["\n", ":", "\"", "*"],
                              "items": {"type": "string", "minLength": 1, "maxLength": 40},
                              "description": "strings no repeat may span (matched inside tokens too)"},
        "penalty_last_n": {"type": "integer", "minimum": -1, "default": -1,
                           "description": "how many of the latest tokens to scan; -1: all, 0: off"},
    },
    "additionalProperties": False,
}


@dataclass(frozen=True)
class DryParams:
    """One request's parameters, ready for every step: breakers as token sequences."""

    multiplier: float
    base: float
    allowed_length: int
    penalty_last_n: int
    breakers: Breakers
    limit: int  # match length past which the penalty stops growing

    @property
    def off(self) -> bool:
        return self.multiplier == 0.0 or self.penalty_last_n == 0


class Dry:
    """Subtracts the DRY penalty from the logit of each token that would extend a repeat."""

    def __init__(self) -> None:
        self._tables: dict[int, BreakerTable] = {}  # by tokenizer

    def prepare(self, args: dict[str, Any], tokenizer: Any) -> DryParams:
        for name in ("multiplier", "base"):
            if not math.isfinite(args[name]):
                raise ValueError(f"{name} must be a finite number, got {args[name]}")
        strings = args["sequence_breakers"]
        if not strings:
            breakers = NO_BREAKERS
        elif tokenizer is None:
            raise ValueError("sequence_breakers need the model's tokenizer, and none was given")
        else:
            table = self._tables.get(id(tokenizer))
            if table is None or table.tokenizer is not tokenizer:
                table = self._tables[id(tokenizer)] = BreakerTable(tokenizer)
            breakers = table.breakers(strings)
        return DryParams(float(args["multiplier"]), float(args["base"]), args["allowed_length"],
                         args["penalty_last_n"], breakers, length_limit(float(args["base"]), args["allowed_length"]))

    def apply(self, logits: torch.Tensor, batch: SamplingBatch, params: list[DryParams]) -> torch.Tensor:
        rows: list[int] = []
        tokens: list[int] = []
        amounts: list[float] = []
        for row, (history, p) in enumerate(zip(batch.token_ids, params)):
            if p.off:
                continue
            single = p.breakers.single
            for token, length in repeat_lengths(history, p.allowed_length, p.penalty_last_n, p.breakers,
                                                p.limit).items():
                if token not in single:
                    rows.append(row)
                    tokens.append(token)
                    amounts.append(-penalty(length, p.multiplier, p.base, p.allowed_length))
        if rows:
            device = logits.device
            logits.index_put_((torch.tensor(rows, device=device), torch.tensor(tokens, device=device)),
                              torch.tensor(amounts, dtype=logits.dtype, device=device), accumulate=True)
        return logits


@hookimpl
def fw_register_samplers(register) -> None:
    register(SamplerSpec("dry", Dry, order=35, per_request=True, parameters=PARAMETERS,
                         description="DRY: penalise tokens that would extend a repeated sequence"))
