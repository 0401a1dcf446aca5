"""The per-step view of a batch that sampler plugins work on: parameters as
tensors (built only when a stage asks), token histories, seeded generators."""

from __future__ import annotations

from functools import cached_property

import torch

from fw.kernels import cpu_ops
from fw.sampling.params import SamplingParams


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's index of its first maximum, as `logits.argmax(dim=-1)` gives it: what greedy rows take.
    fw's one-pass CPU kernel where it applies (2-D rows on the CPU, fw's C++ ops loaded), else torch's."""
    return cpu_ops.argmax(logits) if cpu_ops.usable(logits) else logits.argmax(dim=-1)


class SamplingBatch:
    def __init__(self, seqs: list, vocab_size: int, device: torch.device, eos_token_ids: frozenset[int]):
        self.seqs = seqs
        self.params: list[SamplingParams] = [s.params for s in seqs]
        self.vocab_size = vocab_size
        self.device = device
        self.eos_token_ids = eos_token_ids

    def __len__(self) -> int:
        return len(self.seqs)

    def column(self, values: list, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A [S, 1] tensor of one value per row."""
        return torch.tensor(values, dtype=dtype, device=self.device).unsqueeze(1)

    @cached_property
    def greedy_mask(self) -> torch.Tensor:
        return torch.tensor([p.greedy for p in self.params], device=self.device)

    def subset(self, rows: list[int]) -> "SamplingBatch":
        """The batch of just these rows (in this order): what a per-request stage sees."""
        return SamplingBatch([self.seqs[i] for i in rows], self.vocab_size, self.device, self.eos_token_ids)

    @property
    def num_output_tokens(self) -> list[int]:
        return [s.num_output_tokens for s in self.seqs]

    @property
    def token_ids(self) -> list[list[int]]:
        """Each row's tokens so far, prompt then output (the lists themselves: do not modify them)."""
        return [s.token_ids for s in self.seqs]

    def _padded(self, lists: list[list[int]]) -> torch.Tensor:
        """[S, L] token ids padded with `vocab_size` (an extra, discarded column when scattering)."""
        width = max((len(x) for x in lists), default=0)
        out = torch.full((len(lists), max(width, 1)), self.vocab_size, dtype=torch.long)
        for i, ids in enumerate(lists):
            if ids:
                out[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        return out.to(self.device)

    @cached_property
    def output_token_counts(self) -> torch.Tensor:
        """[S, V] how often each token was generated so far."""
        ids = self._padded([s.output_token_ids for s in self.seqs])
        counts = torch.zeros(len(self), self.vocab_size + 1, dtype=torch.float32, device=self.device)
        counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
        return counts[:, : self.vocab_size]

    @cached_property
    def seen_token_mask(self) -> torch.Tensor:
        """[S, V] tokens present in prompt or output (repetition penalty's domain)."""
        ids = self._padded([s.token_ids for s in self.seqs])
        seen = torch.zeros(len(self), self.vocab_size + 1, dtype=torch.bool, device=self.device)
        seen.scatter_(1, ids, True)
        return seen[:, : self.vocab_size]

    @property
    def generators(self) -> list[torch.Generator | None]:
        return [s.generator for s in self.seqs]
