"""Turns a scheduled batch into flat model inputs and attention metadata, runs
the forward pass, and returns the logits the sampler and prompt logprobs need."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from fw.devices import guard as device_guard
from fw.engine.cpu_runtime import ThreadGovernor
from fw.engine.request import Sequence
from fw.kv_cache import allocation as kv_cache
from fw.layers.attention import AttentionMetadata


@dataclass
class StepLogits:
    sample_seqs: list[Sequence]  # sequences whose step ends at their last token
    # [rows, V] float32: one row per sample sequence, in order; 1 + len(draft) rows for one with a draft
    # (speculative decoding: the logits after its last token and after each draft token)
    sample_logits: torch.Tensor | None
    # (sequence, first prompt position predicted, logits [k, V]) for prompt logprobs
    prompt_logits: list[tuple[Sequence, int, torch.Tensor]]
    # (sequence, first position, hidden states [k, H]) of embedding requests' sequences: pooled, never sampled
    pool_rows: list[tuple[Sequence, int, torch.Tensor]] = field(default_factory=list)


def upload(parts: tuple[list[int], ...], device: torch.device) -> list[torch.Tensor]:
    """Int64 tensors of `parts` on `device`, from one host buffer: on CUDA one pinned buffer and one
    non-blocking copy per step (not a synchronous copy per tensor); on the CPU one tensor and views of it,
    nothing pinned or copied. The tensors are views of one buffer (each starting 16-byte aligned, so Triton
    specialises kernels on their pointers alike every step): read them, do not resize them."""
    flat: list[int] = []
    for part in parts:
        flat.extend(part)
        if len(part) % 2:
            flat.append(0)
    buffer = torch.tensor(flat, dtype=torch.long)
    if device.type == "cuda":
        buffer = buffer.pin_memory().to(device, non_blocking=True)
    elif device.type != "cpu":
        buffer = buffer.to(device)
    views, start = [], 0
    for part in parts:
        views.append(buffer[start:start + len(part)])
        start += len(part) + len(part) % 2
    return views


class ModelRunner:
    def __init__(self, model: nn.Module, attention_backend: type, num_blocks: int, page_size: int,
                 dtype: torch.dtype, device: torch.device):
        self.model = model
        self.backend = attention_backend
        self.page_size = page_size
        self.device = device
        self._logits_buf: torch.Tensor | None = None
        self.compiled = None  # a fw.compile.CompiledStep with --enable-torch-compile (set by fw.compile.attach)
        self.lora = None  # a fw.lora.LoRAManager with --enable-lora (set by the engine)
        self.layers = kv_cache.attention_layers(model)
        # CPU: the thread count follows the cores other processes leave free (a busy neighbour otherwise
        # stalls every parallel region of the step); None elsewhere.
        self.governor = ThreadGovernor.for_this_process() if device.type == "cpu" else None
        kv_cache.allocate(self.layers, attention_backend, num_blocks, page_size, dtype, device)

    @torch.inference_mode()
    def execute(self, seqs: list[Sequence], num_new: list[int]) -> StepLogits:
        if self.governor is not None:
            self.governor.update()
        # Decodes first: backends handle the one-token group together.
        order = sorted(range(len(seqs)), key=lambda i: num_new[i] != 1)
        seqs = [seqs[i] for i in order]
        num_new = [num_new[i] for i in order]
        p = self.page_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        starts = [0]
        sample_seqs, sample_rows = [], []
        for seq, n in zip(seqs, num_new):
            c = seq.num_computed_tokens
            draft = seq.draft_token_ids  # a verify pass: the last token, then the draft (scheduled whole)
            input_ids.extend(seq.token_ids[c:c + n] if not draft else seq.token_ids[c:] + draft)
            positions.extend(range(c, c + n))
            table = seq.block_table
            slots.extend(table[pos // p] * p + pos % p for pos in range(c, c + n))
            seq_lens.append(c + n)
            if c + n == seq.num_tokens + len(draft) and seq.request.pooling is None:  # ends at its last token
                sample_seqs.append(seq)
                sample_rows.extend(range(starts[-1] + n - 1 - len(draft), starts[-1] + n))
            starts.append(starts[-1] + n)
        max_blocks = max(len(s.block_table) for s in seqs)
        tables: list[int] = []  # [B, max_blocks] row-major, padded with page 0
        for seq in seqs:
            tables.extend(seq.block_table)
            tables.extend([0] * (max_blocks - len(seq.block_table)))
        index_rows = self.compiled.padded_rows(sample_rows) if self.compiled is not None else sample_rows
        ids, pos, slot_mapping, query_start_loc, seq_lens_tensor, block_tables, rows = upload(
            (input_ids, positions, slots, starts, seq_lens, tables, index_rows), self.device)
        meta = AttentionMetadata(
            num_decodes=sum(1 for n in num_new if n == 1),
            query_lens=num_new,
            seq_lens=seq_lens,
            query_start_loc=query_start_loc,
            seq_lens_tensor=seq_lens_tensor,
            block_tables=block_tables.view(len(seqs), max_blocks),
            slot_mapping=slot_mapping,
            page_size=p,
        )
        with device_guard(self.device):
            meta.backend_state = self.backend.prepare(meta)
            if self.lora is not None:  # fw.lora: which rows of the step run with which adapter
                self.lora.prepare_step(seqs, num_new, self.device)
            hidden = self.model(ids, pos, meta) if self.compiled is None else self.compiled.forward(ids, pos, meta)
            prompt_logits, pool_rows = [], []
            for seq, n, start in zip(seqs, num_new, starts):
                c = seq.num_computed_tokens
                if seq.request.pooling is not None:
                    pool_rows.append((seq, c, hidden[start:start + n]))
                if seq.params.prompt_logprobs is not None and not seq.request.prompt_logprobs_done and seq.index == 0:
                    # Position j's logits predict token j + 1; keep those whose target is a prompt token.
                    last = min(c + n, seq.num_prompt_tokens - 1)
                    if last > c:
                        prompt_rows = hidden[start:start + (last - c)]
                        prompt_logits.append((seq, c + 1, self.model.compute_logits(prompt_rows).float()))
            logits = None
            if sample_rows and self.compiled is not None:
                logits = self.compiled.logits(hidden, sample_rows, index=rows)
            elif sample_rows:
                logits = self._as_fp32(self.model.compute_logits(hidden.index_select(0, rows)))
        return StepLogits(sample_seqs, logits, prompt_logits, pool_rows)

    def _as_fp32(self, logits: torch.Tensor) -> torch.Tensor:
        """The step's logits in fp32, in a buffer kept across steps: a fresh tensor each step costs
        more in first-touch page faults than the copy itself (docs/performance.md). Valid until the
        next step (the sampler consumes it within the step)."""
        if logits.dtype == torch.float32:
            return logits
        rows, vocab = logits.shape
        buf = self._logits_buf
        if buf is None or buf.shape[0] < rows or buf.shape[1] != vocab or buf.device != logits.device:
            buf = self._logits_buf = torch.empty(max(rows, 1), vocab, dtype=torch.float32, device=logits.device)
        return buf[:rows].copy_(logits)
