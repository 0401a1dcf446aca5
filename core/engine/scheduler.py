"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every sequence has `num_computed_tokens` of `num_tokens`; a step gives it up to
`prefill_chunk_size` more within the step's token budget, so decode (one
token), chunked prefill and recompute after preemption are the same rule.
A sequence with a draft (speculative decoding) counts its draft tokens among
its tokens to compute; the draft is cut to fit the budget, and dropped before
anything is preempted for its pages. Running sequences are served first,
oldest first; when pages run out the newest running sequence is preempted
(pages freed, recomputed later). With LoRA on, a waiting request whose adapter would make more
than --max-loras distinct adapters run at once waits; those behind it may start.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from fw.kv_cache.pages import PageManager
from fw.engine.request import Sequence, SeqStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, block_manager: PageManager, max_batch_size: int, max_batch_tokens: int, chunk_size: int):
        self.blocks = block_manager
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.chunk_size = chunk_size
        self.max_loras: int | None = None  # --max-loras with LoRA on: the most distinct adapters running at once
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_batch_tokens
        running = list(self.running)
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            n = min(seq.num_tokens + len(seq.draft_token_ids) - seq.num_computed_tokens, self.chunk_size, budget)
            if seq.draft_token_ids:
                del seq.draft_token_ids[n - 1:]
                if not self.blocks.allocate(seq, n):
                    seq.draft_token_ids.clear()  # a plain decode rather than a preemption
                    n = 1
            while not self.blocks.allocate(seq, n):
                victim = running.pop()  # newest first
                self._preempt(victim, batch)
                if victim is seq:
                    break
            else:
                batch.seqs.append(seq)
                batch.num_new_tokens.append(n)
                budget -= n
                i += 1
        if not batch.preempted:
            self._admit_waiting(batch, budget)
        return batch

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        held_back: list[Sequence] = []  # their LoRA adapter would exceed --max-loras: they keep their place
        while self.waiting and budget > 0 and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            if not self._adapter_fits(seq):
                held_back.append(self.waiting.popleft())
                continue
            self.blocks.match_prefix(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, self.chunk_size, budget)
            if not self.blocks.allocate(seq, n):
                self.blocks.undo_match(seq)
                if not self.running and not batch.seqs:
                    # Nothing else holds pages: this sequence can never fit.
                    raise RuntimeError(
                        f"the KV cache ({self.blocks.num_blocks} pages of {self.blocks.page_size} tokens) "
                        f"cannot hold one sequence of {seq.num_tokens} tokens; raise --kv-cache-memory"
                    )
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        self.waiting.extendleft(reversed(held_back))

    def _adapter_fits(self, seq: Sequence) -> bool:
        """Whether `seq` may join the running sequences without more than --max-loras distinct adapters (vLLM's
        rule: a request whose adapter has no room waits, the requests behind it may go)."""
        name = seq.request.lora_name
        if self.max_loras is None or name is None:
            return True
        active = {s.request.lora_name for s in self.running} - {None}
        return name in active or len(active) < self.max_loras

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        self.blocks.release(seq)
        seq.draft_token_ids.clear()
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)
        if seq in batch.seqs:
            k = batch.seqs.index(seq)
            del batch.seqs[k], batch.num_new_tokens[k]

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its pages at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq)
        seq.status = SeqStatus.FINISHED
