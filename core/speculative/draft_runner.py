"""A second model run by fw beside the target: speculative decoding's draft model (docs/speculative.md).

`DraftRunner` loads the draft through the engine's own loader (the same plugins, device and dtype as the
target), gives it a paged KV cache and a model runner of its own, and keeps one draft sequence per target
sequence in step with what the target accepted: at each call, the draft sequence's tokens are cut back
to the longest prefix the target's tokens share with them (what the draft proposed and the target
rejected goes), the pages past it are given back, and the draft computes what it has not seen yet. The
built-in `draft_model` proposer drafts with it; an EAGLE-style head could
too. Provisional: not part of the stable plugin API.

A draft must share the target's tokenizer (same tokens, same ids), or its token ids would mean other
text: `check_same_tokenizer` refuses one that does not when the engine starts.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from dataclasses import dataclass
from typing import Any, Sequence as Seq

import torch

from fw.config import EngineConfig, parse_size
from fw.engine.model_runner import ModelRunner
from fw.engine.request import Request, Sequence
from fw.errors import ConfigError
from fw.kv_cache import allocation as kv_cache
from fw.kv_cache.pages import PageManager
from fw.model.loader import LoadedModel, load_model
from fw.sampling.params import SamplingParams
from fw.speculative.config import FLAG, SpeculativeConfig
from fw.speculative.contract import DraftRequest, ProposerContext

logger = logging.getLogger("fw.speculative")

_PARAMS = SamplingParams(max_tokens=None, speculative=False)  # what a draft sequence's runner reads


def draft_engine_config(target: EngineConfig, model: str, options: dict[str, Any]) -> EngineConfig:
    """The target's configuration for the draft: same device, dtype, plugins and paging; the draft's own
    checkpoint, revision, quantization and context length; nothing of the target's model-specific or
    serving options (tokenizer, chat template, weight encoding, LoRA, compilation, tensor parallelism,
    speculation). The target's --quantization-encoding already set its --dtype, which the draft keeps."""
    return dataclasses.replace(
        target, model=model, revision=options.get("revision"), tokenizer=None, chat_template=None,
        quantization=options.get("quantization"), quantization_encoding=None, max_length=options.get("max_model_len"),
        speculative_config=None, enable_lora=False, lora_modules=[], enable_torch_compile=False,
        compile_mode=None, tensor_parallel_size=1, nnodes=1, node_rank=0, task="generate",
        rope_type="none")


def check_same_tokenizer(target: Any, draft: Any, model: str) -> None:
    """Refuse a draft whose tokenizer maps any token to another id than the target's does."""
    want, got = target.get_vocab(), draft.get_vocab()
    if want == got:
        return
    if len(want) != len(got):
        why = f"its vocabulary has {len(got)} tokens, the target's {len(want)}"
    else:
        token = next(t for t in sorted(want) if got.get(t) != want[t])
        why = f"token {token!r} is id {got.get(token)} in the draft, {want[token]} in the target"
    raise ConfigError(f"{FLAG}: draft model {model}: its tokenizer is not the target's ({why}). A draft model "
                      f"must use the target's tokenizer (same tokens, same ids): pick one from the target's "
                      f"family, or use method ngram")


@dataclass
class _Track:
    """One target sequence's draft sequence. `synced`: how many of its tokens are the target's (the rest,
    up to one per draft position, are the draft's own proposals of the last call)."""

    seq: Sequence
    synced: int
    used: int  # the call that last drafted for it (least recently used tracks are evicted first)


class DraftRunner:
    """The draft model and its KV pages. `start(requests)` syncs each request's draft sequence and
    computes what the draft has not seen, returning the draft's logits after each sequence's last token
    (over the target's vocabulary); `advance(seqs, tokens)` appends one proposed token per sequence and
    returns the logits after it; `release(seq_id)` gives a sequence's pages back."""

    def __init__(self, model: str, options: dict[str, Any], context: ProposerContext):
        target = context.engine_config
        if target is None or context.plugins is None:
            raise ValueError("a draft model needs the engine's configuration and plugins in its ProposerContext")
        self.config = draft_engine_config(target, model, options)
        self.loaded: LoadedModel = load_model(self.config, context.plugins)
        check_same_tokenizer(context.tokenizer, self.loaded.tokenizer, model)
        self.model_name = model
        self.vocab_size = context.vocab_size  # the target's: logits are cut or padded to it
        self.max_length = self.loaded.max_length
        self.page_size = target.kv_cache_page_size
        spec = SpeculativeConfig.parse(target.speculative_config)
        num_blocks = self._num_blocks(spec, context.num_speculative_tokens)
        self.blocks = PageManager(num_blocks, self.page_size, False)
        loaded = self.loaded
        self.runner = ModelRunner(loaded.model, loaded.attention.chosen.backend_cls, num_blocks, self.page_size,
                                  loaded.dtype, loaded.device)
        self.runner.governor = None  # the target's runner fits the process's threads; one governor is enough
        self.chunk_tokens = target.step_tokens
        self.tracks: dict[int, _Track] = {}
        self._calls = itertools.count()
        logger.info("draft model %s (%s): %d KV pages of %d tokens", model, loaded.dtype, num_blocks, self.page_size)

    def _num_blocks(self, spec: SpeculativeConfig | None, k: int) -> int:
        """Pages for the sequences that can draft at once (fewer than disable_by_batch_size) at the
        draft's full length, within the target's KV budget (--num-kv-blocks pages, --kv-cache-memory on
        CPU, the free device memory on GPU)."""
        target, loaded = self.config, self.loaded
        drafting = min(target.max_batch_size, spec.disable_by_batch_size - 1 if spec else target.max_batch_size)
        wanted = max(1, drafting) * -(-(self.max_length + k) // self.page_size)
        if target.num_kv_blocks:
            return target.num_kv_blocks
        per_block = kv_cache.bytes_per_page(loaded.model, loaded.attention.chosen.backend_cls, self.page_size,
                                            loaded.dtype)
        if loaded.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(loaded.device)
            budget, flag = free // 2, "--device-memory-utilization (lower it to leave room for the draft)"
        else:
            budget, flag = parse_size(target.kv_cache_memory), "--kv-cache-memory"
        blocks = min(wanted, int(budget // per_block))
        if blocks < -(-(k + 2) // self.page_size) + 1:
            raise ConfigError(f"{FLAG}: no room for draft model {self.model_name}'s KV cache: one page needs "
                              f"{per_block} bytes, {int(budget)} are left; raise {flag}")
        return blocks

    # -- keeping draft sequences in step ------------------------------------------------------

    def _track(self, request: DraftRequest, call: int) -> _Track:
        track = self.tracks.get(request.seq_id)
        if track is None:
            req = Request(f"draft-{request.seq_id}", None, [], _PARAMS)
            seq = Sequence(req, 0, _PARAMS, [], 0, None)
            track = self.tracks[request.seq_id] = _Track(seq, 0, call)
        track.used = call
        seq, tokens = track.seq, request.token_ids
        # The first `synced` tokens are the target's; after them the draft's proposals, of which the target
        # kept a prefix. Keep KV up to the common prefix, and always compute the last token again: its
        # logits are the first draft position's.
        common = track.synced
        limit = min(len(seq.token_ids), len(tokens))
        while common < limit and seq.token_ids[common] == tokens[common]:
            common += 1
        seq.num_computed_tokens = min(seq.num_computed_tokens, common, len(tokens) - 1)
        del seq.token_ids[seq.num_computed_tokens:]
        seq.token_ids.extend(tokens[seq.num_computed_tokens:])
        track.synced = len(tokens)
        self.blocks.truncate(seq, seq.num_computed_tokens)
        return track

    def _allocate(self, seq: Sequence, num_tokens: int, keep: set[int]) -> bool:
        """Pages for `num_tokens` more tokens; on a full cache, evict the least recently drafted
        sequences outside this call first."""
        if self.blocks.allocate(seq, num_tokens):
            return True
        idle = sorted((t.used, sid) for sid, t in self.tracks.items() if sid not in keep)
        for _, sid in idle:
            self.release(sid)
            if self.blocks.allocate(seq, num_tokens):
                return True
        return False

    def start(self, requests: Seq[DraftRequest]) -> tuple[list[int], list[Sequence], torch.Tensor | None]:
        """Sync the requests' draft sequences and compute their new tokens. Returns the indexes of the
        requests that can draft (their k fits the draft's length and pages), their draft sequences and
        the logits after each one's last token [len, vocab] (None when none can)."""
        call = next(self._calls)
        keep = {r.seq_id for r in requests}
        index, seqs = [], []
        for i, request in enumerate(requests):
            if len(request.token_ids) + request.max_tokens - 1 > self.max_length:
                continue  # the draft's context is shorter than the target's
            track = self._track(request, call)
            seq = track.seq
            if not self._allocate(seq, seq.num_tokens - seq.num_computed_tokens + request.max_tokens - 1, keep):
                self.release(request.seq_id)
                continue
            index.append(i)
            seqs.append(seq)
        if not seqs:
            return [], [], None
        return index, seqs, self._compute_new(seqs)

    def _compute_new(self, seqs: list[Sequence]) -> torch.Tensor:
        """Forward every sequence's uncomputed tokens, in chunks of at most --max-batch-input-tokens per
        forward; the logits after each one's last token, in the order of `seqs`."""
        rows: dict[int, torch.Tensor] = {}
        while len(rows) < len(seqs):
            budget = self.chunk_tokens
            batch, counts = [], []
            for seq in seqs:
                left = seq.num_tokens - seq.num_computed_tokens
                if left == 0 or budget == 0:
                    continue
                n = min(left, budget)
                batch.append(seq)
                counts.append(n)
                budget -= n
            rows.update(self._forward(batch, counts))
        return torch.stack([rows[id(s)] for s in seqs])

    def advance(self, seqs: list[Sequence], tokens: list[int]) -> torch.Tensor:
        """Append one token to each sequence, compute it, and return the logits after it [len, vocab]."""
        for seq, token in zip(seqs, tokens):
            seq.token_ids.append(token)
        rows = self._forward(seqs, [1] * len(seqs))
        return torch.stack([rows[id(s)] for s in seqs])

    def _forward(self, seqs: list[Sequence], counts: list[int]) -> dict[int, torch.Tensor]:
        result = self.runner.execute(seqs, counts)
        for seq, n in zip(seqs, counts):
            seq.num_computed_tokens += n
        logits = result.sample_logits
        out = {}
        for r, seq in enumerate(result.sample_seqs):
            row = logits[r]
            if row.shape[0] > self.vocab_size:  # a draft with a larger (padded) embedding
                row = row[:self.vocab_size]
            elif row.shape[0] < self.vocab_size:
                row = torch.cat([row, row.new_full((self.vocab_size - row.shape[0],), float("-inf"))])
            out[id(seq)] = row.clone()  # the runner reuses its logits buffer at the next forward
        return out

    def release(self, seq_id: int) -> None:
        track = self.tracks.pop(seq_id, None)
        if track is not None:
            self.blocks.release(track.seq)


__all__ = ["DraftRunner", "check_same_tokenizer", "draft_engine_config"]
