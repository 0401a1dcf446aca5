"""The built-in sampler plugin: logits stages (allowed token ids, logit bias, min_tokens,
penalties, temperature, top-k, top-p, min-p) and the default final choice (greedy or
seeded random). Every stage works on the whole batch at once; rows whose
parameters leave a stage neutral pass through unchanged."""

from __future__ import annotations

import torch

from fw.plugins import SamplerSpec, hookimpl
from fw.sampling.batch import SamplingBatch, argmax

FW_PLUGIN_API_VERSION = "1.8"  # fw.sampling.batch.argmax
NEG_INF = float("-inf")


class AllowedTokenIds:
    """vLLM's allowed_token_ids: every other token is set to -inf for rows that give the field."""

    def is_active(self, p) -> bool:
        return p.allowed_token_ids is not None

    def apply(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        vocab = logits.shape[1]
        keep = torch.ones(logits.shape, dtype=torch.bool, device=logits.device)
        for i, p in enumerate(batch.params):
            if p.allowed_token_ids is not None:
                ids = torch.tensor(p.allowed_token_ids, dtype=torch.long, device=logits.device)
                keep[i] = False
                keep[i, ids[(ids >= 0) & (ids < vocab)]] = True
        return logits.masked_fill_(~keep, NEG_INF)


class LogitBias:
    def is_active(self, p) -> bool:
        return bool(p.logit_bias)

    def apply(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        for i, p in enumerate(batch.params):
            for token, bias in (p.logit_bias or {}).items():
                if 0 <= int(token) < logits.shape[1]:
                    logits[i, int(token)] += float(bias)
        return logits


class MinTokens:
    """Forbid end-of-sequence tokens until min_tokens have been generated."""

    def is_active(self, p) -> bool:
        return p.min_tokens > 0

    def apply(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        for i, (p, n) in enumerate(zip(batch.params, batch.num_output_tokens)):
            if n < p.min_tokens:
                banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(batch.eos_token_ids))
                if banned:
                    logits[i, list(banned)] = NEG_INF
        return logits


class Penalties:
    """Repetition (HF semantics, over prompt and output), frequency and presence (OpenAI, over output)."""

    def is_active(self, p) -> bool:
        return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0

    def apply(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        params = batch.params
        rep = [p.repetition_penalty for p in params]
        if any(r != 1.0 for r in rep):
            r = batch.column(rep)
            penalised = torch.where(logits > 0, logits / r, logits * r)
            logits = torch.where(batch.seen_token_mask, penalised, logits)
        freq = [p.frequency_penalty for p in params]
        pres = [p.presence_penalty for p in params]
        if any(freq) or any(pres):
            counts = batch.output_token_counts
            logits = logits - batch.column(freq) * counts - batch.column(pres) * (counts > 0).float()
        return logits


class Temperature:
    def is_active(self, p) -> bool:
        return not p.greedy and p.temperature != 1.0

    def apply(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        return logits / batch.column([p.temperature if not p.greedy else 1.0 for p in batch.params])


class TopK:
    def is_active(self, p) -> bool:
        return not p.greedy and p.top_k > 0

    def apply(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        vocab = logits.shape[1]
        ks = [min(p.top_k, vocab) if p.top_k > 0 and not p.greedy else vocab for p in batch.params]
        kmax = max(ks)
        top = torch.topk(logits, kmax, dim=-1).values
        kth = top.gather(1, torch.tensor(ks, device=logits.device).unsqueeze(1) - 1)
        return logits.masked_fill(logits < kth, NEG_INF)


class TopP:
    def is_active(self, p) -> bool:
        return not p.greedy and p.top_p < 1.0

    def apply(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        top_p = batch.column([p.top_p if not p.greedy else 1.0 for p in batch.params])
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly before each token
        # Rows with top_p 1 are exempt: their cumulative mass can round to 1 before the tail.
        remove_sorted = (before >= top_p) & (top_p < 1.0)
        remove_sorted[:, 0] = False  # always keep the most likely token
        remove = torch.zeros_like(remove_sorted).scatter_(1, order, remove_sorted)
        return logits.masked_fill(remove, NEG_INF)


class MinP:
    def is_active(self, p) -> bool:
        return not p.greedy and p.min_p > 0.0

    def apply(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        probs = logits.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * batch.column([p.min_p for p in batch.params])
        return logits.masked_fill(probs < threshold, NEG_INF)


class DefaultChoice:
    """Greedy rows take the argmax; others sample by the exponential race
    (argmax of p / E, E ~ Exp(1)), seeded rows from their own generator so a
    seed gives the same tokens whatever else is in the batch."""

    def choose(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        greedy = argmax(logits)
        if all(p.greedy for p in batch.params):
            return greedy
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs)
        for i, (gen, p) in enumerate(zip(batch.generators, batch.params)):
            # A greedy row leaves its generator alone, so what a stage draws from it (XTC) does not
            # depend on whether the batch has sampled rows.
            if gen is not None and not p.greedy:
                noise[i].exponential_(generator=gen)
        unseeded = [i for i, g in enumerate(batch.generators) if g is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_()
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(batch.greedy_mask, greedy, sampled)


@hookimpl
def fw_register_samplers(register) -> None:
    register(SamplerSpec("logit_bias", LogitBias, order=10, description="OpenAI logit_bias"))
    register(SamplerSpec("min_tokens", MinTokens, order=20, description="no EOS before min_tokens"))
    register(SamplerSpec("penalties", Penalties, order=30,
                         description="repetition, frequency and presence penalties"))
    register(SamplerSpec("temperature", Temperature, order=40))
    register(SamplerSpec("top_k", TopK, order=50))
    register(SamplerSpec("top_p", TopP, order=60))
    register(SamplerSpec("min_p", MinP, order=70))
    register(SamplerSpec("default", DefaultChoice, role="choice",
                         description="greedy at temperature 0, else seeded exponential-race sampling"))
    # Registered last so listings keep their order; it runs first (order 5).
    register(SamplerSpec("allowed_token_ids", AllowedTokenIds, order=5,
                         description="only the request's allowed_token_ids can be generated"))
