"""The engine for encoder-only models (BERT and kin): embeddings, no KV cache, no pages.

It has the front contract of `LLMEngine` (`add_request`, `step`, `abort_request`,
`has_unfinished_requests`, `stats`), so `LLM`, the server's engine thread and its metrics drive it
unchanged. The paged-KV step cannot serve an encoder: its attention is causal over cached pages,
while an encoder's token sees the whole sequence and keeps nothing for later. So each step here takes
waiting requests first come, first served, up to --max-batch-size sequences and
--max-batch-input-tokens tokens, runs one bidirectional forward over them packed flat, pools and
returns them all finished. Requests arriving meanwhile join the next step."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from fw.config import EngineConfig
from fw.devices import guard as device_guard
from fw.engine.cpu_runtime import ThreadGovernor, release_load_memory, tune_malloc
from fw.engine.intake import request_id_and_ids
from fw.engine.outputs import EmbeddingOutput, EmbeddingRequestOutput
from fw.errors import InvalidRequestError, PromptTooLongError
from fw.layers.encoder import EncoderMetadata
from fw.model.loader import load_model
from fw.plugins.manager import PluginManager, engine_plugins
from fw.pooling.config import engine_pooling
from fw.pooling.params import PoolingParams
from fw.pooling.pooler import finish, pool_packed
from fw.warm import startup

logger = logging.getLogger("fw.pooling")


@dataclass(eq=False)
class EmbedRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: PoolingParams
    arrival_time: float = field(default_factory=time.monotonic)


class EncoderEngine:
    task = "embed"

    def __init__(self, config: EngineConfig, plugins: PluginManager | None = None):
        config = self.config = dataclasses.replace(config, task="embed")
        self.startup_report = startup.begin()
        if not str(config.device).startswith("cuda"):
            tune_malloc()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        self.plugins = engine_plugins(config, plugins)
        loaded = self.loaded = load_model(config, self.plugins)
        self.tokenizer = loaded.tokenizer
        self.vocab_size = loaded.hf_config.vocab_size
        self.pooling = engine_pooling(config, loaded)
        # the longest input: --max-length, else the length the sentence-transformers model was trained on
        # (what sentence-transformers itself cuts inputs to), else the model's position table
        self.max_length = config.max_length or min(self.pooling.max_seq_length or loaded.max_length,
                                                   loaded.max_length)
        self.governor = ThreadGovernor.for_this_process() if loaded.device.type == "cpu" else None
        if loaded.device.type == "cpu":
            release_load_memory()
        self.waiting: deque[EmbedRequest] = deque()
        self.requests: dict[str, EmbedRequest] = {}
        self._ids = itertools.count()
        self._counts = {"num_embedded": 0, "num_embedded_tokens": 0, "num_encoder_steps": 0}

    # -- requests ------------------------------------------------------------------------

    def new_request_id(self) -> str:
        return f"embd-{next(self._ids)}"

    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt).input_ids

    def add_request(self, request_id: str | None = None, prompt: str | None = None,
                    prompt_token_ids: list[int] | None = None, params: PoolingParams | None = None,
                    delta: bool = False) -> EmbedRequest:
        """Queue one input; errors a caller can fix raise here (400s). `delta` is accepted for the
        front contract and means nothing: an embedding comes back whole."""
        params = params if params is not None else PoolingParams()
        if not isinstance(params, PoolingParams):
            raise InvalidRequestError(
                f"{self.loaded.source.name} is an encoder-only embedding model ({self.loaded.architecture.name}): it "
                f"serves embeddings (/v1/embeddings, LLM.embed), not text generation")
        request_id, ids = request_id_and_ids(self.requests, self.new_request_id, self.tokenize, request_id, prompt,
                                             prompt_token_ids, missing="give an input text or token ids",
                                             param="input")
        self._validate(ids, params)
        req = EmbedRequest(request_id, prompt, ids, params)
        self.requests[request_id] = req
        self.waiting.append(req)
        return req

    def _validate(self, ids: list[int], params: PoolingParams) -> None:
        if not ids:
            raise InvalidRequestError("the input is empty; give at least one token", param="input")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"input token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})", param="input")
        if len(ids) > self.max_length:
            raise PromptTooLongError(
                f"the input has {len(ids)} tokens, more than the {self.max_length} this model embeds at once "
                f"(--max-length; default: the model's sentence-transformers max_seq_length, else its "
                f"position table); shorten or split it", param="input")
        self.pooling.check_dimensions(params.dimensions, self.loaded.source.name)

    def abort_request(self, request_id: str) -> EmbeddingRequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.waiting.remove(req)
        return EmbeddingRequestOutput(req.request_id, req.prompt, req.prompt_token_ids, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_work(self) -> bool:
        return bool(self.waiting)

    # -- the step ------------------------------------------------------------------------

    def _take(self) -> list[EmbedRequest]:
        """Waiting requests in arrival order while the batch has room (the first always fits)."""
        batch: list[EmbedRequest] = []
        tokens = 0
        while self.waiting and len(batch) < self.config.max_batch_size:
            n = len(self.waiting[0].prompt_token_ids)
            if batch and tokens + n > self.config.step_tokens:
                break
            batch.append(self.waiting.popleft())
            tokens += n
        return batch

    def step(self) -> list[EmbeddingRequestOutput]:
        batch = self._take()
        if not batch:
            return []
        if self.governor is not None:
            self.governor.update()
        device = self.loaded.device
        lens = [len(r.prompt_token_ids) for r in batch]
        ids = torch.tensor([t for r in batch for t in r.prompt_token_ids], dtype=torch.long)
        with torch.inference_mode(), device_guard(device):
            meta = EncoderMetadata.build(lens, device)
            hidden = self.loaded.model(ids.to(device), meta.positions, meta)
            vectors = pool_packed(hidden, self.pooling.method, meta.cu_seqlens, meta.seq_index, lens)
        embeddings = finish(vectors, self.pooling, [r.params.dimensions for r in batch])
        now = time.monotonic()
        outputs = []
        for req, vector in zip(batch, embeddings):
            del self.requests[req.request_id]
            outputs.append(EmbeddingRequestOutput(req.request_id, req.prompt, req.prompt_token_ids,
                                                  EmbeddingOutput(vector.tolist()),
                                                  metrics={"arrival_time": req.arrival_time,
                                                           "finished_time": now}))
        self._counts["num_embedded"] += len(batch)
        self._counts["num_embedded_tokens"] += sum(lens)
        self._counts["num_encoder_steps"] += 1
        return outputs

    def stats(self) -> dict:
        """The keys `LLMEngine.stats()` has (a KV cache of none), and what this engine counts."""
        return {"num_running": 0, "num_waiting": len(self.waiting), "kv_cache_usage": 0.0, "num_kv_blocks": 0,
                "prefix_cache_queried_tokens": 0, "prefix_cache_hit_tokens": 0, "num_preemptions": 0,
                **self._counts}
