"""Helpers for the DRY plugin's tests: the plugin importable from the checkout when it is not
installed, fw's sampler pipeline with the built-in samplers plus DRY (as the engine builds it),
sequences with given token histories, and a toy tokenizer with a vocabulary written by hand."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

PLUGIN_ROOT = Path(__file__).resolve().parent.parent

try:  # the installed package, else the checkout (the tests run without installing the plugin)
    import fw_sampler_dry  # noqa: F401
except ImportError:
    sys.path.insert(0, str(PLUGIN_ROOT))

from fw.sampling.batch import SamplingBatch  # noqa: E402
from fw.sampling.params import SamplingParams  # noqa: E402
from fw.testing import FakeSequence as FakeSeq  # noqa: E402
from fw.testing import sampler_pipeline as fw_sampler_pipeline  # noqa: E402


def sampler_pipeline():
    """fw's SamplerPipeline over the built-in samplers and this plugin, loaded as entry points."""
    return fw_sampler_pipeline("dry", "fw_sampler_dry.plugin")


def batch_of(rows: list[tuple[SamplingParams, list[int]]], vocab: int) -> SamplingBatch:
    return SamplingBatch([FakeSeq(p, ids) for p, ids in rows], vocab, torch.device("cpu"), frozenset())


def sample(pipeline, rows: list[tuple[SamplingParams, list[int]]], logits: torch.Tensor,
           tokenizer=None) -> list[int]:
    """Admit each row's params as the engine does (validate, with the tokenizer), then one step."""
    for params, _ in rows:
        pipeline.validate(params, tokenizer)
    return pipeline.sample(logits.clone(), batch_of(rows, logits.shape[1])).token_ids


def greedy(samplers=None, **extra) -> SamplingParams:
    return SamplingParams(temperature=0, samplers=samplers, **extra)


def dry(**args) -> dict:
    """A `samplers` entry for DRY; no sequence breakers unless given (the defaults need a tokenizer)."""
    args.setdefault("sequence_breakers", [])
    return {"name": "dry", **args}


class ToyTokenizer:
    """A tokenizer over a hand-written vocabulary (one string per id): decode joins the strings,
    encode takes the longest vocabulary string at each position."""

    def __init__(self, vocab: list[str]):
        self.vocab = vocab

    def __len__(self) -> int:
        return len(self.vocab)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(self.vocab[i] for i in ids)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids, pos = [], 0
        while pos < len(text):
            best = max((i for i, w in enumerate(self.vocab) if w and text.startswith(w, pos)),
                       key=lambda i: len(self.vocab[i]))
            ids.append(best)
            pos += len(self.vocab[best])
        return ids
