"""The built-in `draft_model` proposer: a second, smaller model with the target's tokenizer drafts the next
k tokens (Leviathan et al. 2023; vLLM's `draft_model` method).

    --speculative-config '{"method": "draft_model", "model": "path/to/small", "num_speculative_tokens": 4}'

fw runs the draft itself (fw.speculative.draft_runner: its own weights, paged KV cache and model runner,
kept in step with the tokens the target accepted). Each step it computes, for all drafting sequences in
one batch, what the draft has not seen yet and then k - 1 one-token steps. For a greedy request it drafts
the draft's argmax (a deterministic draft, no probabilities); for a sampled one it samples from the
draft's distribution at the request's temperature and returns that distribution, q, for the rejection
rule min(1, p/q). Either way the output is distributed exactly as the target's.
"""

from __future__ import annotations

from typing import Sequence

import torch

from fw.plugins import ProposerSpec, hookimpl
from fw.speculative import Draft, DraftRequest, ProposerContext
from fw.speculative.draft_runner import DraftRunner

FW_PLUGIN_API_VERSION = "1.3"

PARAMETERS = {
    "type": "object",
    "properties": {
        "model": {"type": "string", "minLength": 1,
                  "description": "the draft: a local directory, a .gguf file or a hub id, with the target's "
                                 "tokenizer"},
        "revision": {"type": ["string", "null"], "description": "hub revision of the draft"},
        "quantization": {"type": ["string", "null"],
                         "description": "quantization method of the draft; default: from its checkpoint"},
        "max_model_len": {"type": ["integer", "null"], "minimum": 2,
                          "description": "the draft's context length; default: its config's"},
        "draft_tensor_parallel_size": {"type": "integer", "const": 1,
                                       "description": "the draft runs unsplit, in the engine's process"},
    },
    "required": ["model"],
    "additionalProperties": False,
}


class DraftModelProposer:
    def __init__(self, runner: DraftRunner, eos_token_ids: frozenset[int], seed: int):
        self.runner = runner
        self.eos = eos_token_ids
        self.device = runner.loaded.device
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.seeded: dict[int, torch.Generator] = {}  # seq_id -> its drafts' generator (seeded requests)

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft | None]:
        out: list[Draft | None] = [None] * len(requests)
        index, seqs, logits = self.runner.start(requests)
        if not seqs:
            return out
        reqs = [requests[i] for i in index]
        ids: list[list[int]] = [[] for _ in reqs]
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        active = list(range(len(reqs)))
        while True:
            for a, row in zip(active, logits):
                token, q = self._choose(reqs[a], row)
                ids[a].append(token)
                if q is not None:
                    probs[a].append(q)
            active = [a for a in active if len(ids[a]) < reqs[a].max_tokens and not self._ends(reqs[a], ids[a][-1])]
            if not active:
                break
            logits = self.runner.advance([seqs[a] for a in active], [ids[a][-1] for a in active])
        for a, i in enumerate(index):
            out[i] = Draft(ids[a], torch.stack(probs[a]) if probs[a] else None)
        return out

    def _ends(self, request: DraftRequest, token: int) -> bool:
        """A drafted EOS ends the draft: the target stops there if it accepts it."""
        return token in self.eos and not request.params.ignore_eos

    def _choose(self, request: DraftRequest, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """Greedy requests: the draft's argmax, a point mass. Sampled ones: a draw from the draft's
        softmax at the request's temperature, and that distribution (q)."""
        params = request.params
        if params.greedy:
            return int(logits.argmax()), None
        q = torch.softmax(logits.float() / params.temperature, dim=-1)
        generator = self.generator
        if params.seed is not None:  # reproducible run to run, whatever else shares the batch
            generator = self.seeded.get(request.seq_id)
            if generator is None:
                generator = self.seeded[request.seq_id] = torch.Generator(device=self.device).manual_seed(params.seed)
        return int(torch.multinomial(q, 1, generator=generator)), q

    def release(self, seq_id: int) -> None:
        self.seeded.pop(seq_id, None)
        self.runner.release(seq_id)


def build(args: dict, context: ProposerContext) -> DraftModelProposer:
    runner = DraftRunner(args["model"], args, context)
    seed = getattr(context.engine_config, "seed", 0)
    return DraftModelProposer(runner, context.eos_token_ids, seed)


@hookimpl
def fw_register_proposers(register) -> None:
    register(ProposerSpec("draft_model", build, parameters=PARAMETERS,
                          description="a smaller model with the target's tokenizer drafts k tokens (run by fw, "
                                      "with its own KV cache)"))
