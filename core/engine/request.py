"""A request and its sequences (one per `n`), with their per-step state."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

import torch

from fw.engine.detokenizer import IncrementalDetokenizer
from fw.engine.outputs import Logprob
from fw.grammar.service import SequenceGrammar
from fw.pooling.pooler import PoolingState
from fw.sampling.params import SamplingParams
from fw.speculative.service import SpeculationState


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_seq_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One output stream: prompt + generated tokens, its KV pages and sampler state."""

    request: "Request"
    index: int
    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None = None
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0
    block_hashes: list[bytes] = field(default_factory=list)  # SHA-256 of each full page, chained
    num_cached_tokens: int = 0
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_text_len: int = 0  # for streaming deltas
    sent_token_len: int = 0
    num_preemptions: int = 0
    grammar: SequenceGrammar | None = None  # structured output: this sequence's matcher
    # speculative decoding (fw.speculative): this step's draft, verified in the step, and the sequence's counters
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None  # [len(draft), V] from a proposer that samples its drafts
    speculation: SpeculationState | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    delta: bool = False  # stream deltas instead of cumulative outputs
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_done: bool = False
    pooling: PoolingState | None = None  # an embedding request (--task embed): its prompt's states pooled
    lora_name: str | None = None  # the LoRA adapter it runs with (fw.lora); None: the base model
    # where its pages' prefix-cache keys start: requests that compute the same tokens differently (another
    # adapter) must not share pages
    cache_salt: bytes = b""

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)
