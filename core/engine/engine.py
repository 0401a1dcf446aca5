"""The engine: requests in, one scheduled step at a time, outputs out.

One engine serves the library, the CLI and the server. `step()` runs one
forward pass over the scheduled batch, samples, detokenizes, applies stop
rules and returns an output for every request that progressed.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time

import torch

from fw.config import EngineConfig
from fw.distributed.cluster import Cluster
from fw.engine.cpu_runtime import loading_threads, release_load_memory, spare_old_objects, tune_malloc
from fw.engine.detokenizer import IncrementalDetokenizer
from fw.engine.intake import request_id_and_ids
from fw.engine.model_runner import ModelRunner
from fw.engine.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from fw.engine.request import Request, Sequence
from fw.engine.scheduler import Scheduler
from fw.errors import ConfigError, InvalidRequestError, PromptTooLongError
from fw.grammar.service import GrammarService, SequenceGrammar
from fw.grammar.tokenizer import GrammarTokenizer
from fw.kv_cache import allocation as kv_cache
from fw.kv_cache.pages import PageManager
from fw.model.loader import load_model
from fw.plan.rules import resolve_device
from fw.plugins.manager import PluginManager, engine_plugins
from fw.lora.request import LoRARequest
from fw.pooling.config import READS_EVERY_POSITION, engine_pooling
from fw.pooling.params import PoolingParams
from fw.pooling.pooler import PoolingState, finish
from fw.sampling.batch import SamplingBatch
from fw.sampling.params import SamplingParams
from fw.sampling.pipeline import SamplerPipeline, token_logprobs
from fw.speculative.config import SpeculativeConfig
from fw.speculative.contract import ProposerContext
from fw.speculative.rejection import accepted_prefix, verify
from fw.speculative.service import Speculator
from fw.warm import startup

logger = logging.getLogger("fw.engine")

# An embedding request's sequence computes its prompt and stops: no output token, no speculation.
_PREFILL_ONLY = SamplingParams(max_tokens=0, speculative=False)


class LLMEngine:
    def __init__(self, config: EngineConfig, plugins: PluginManager | None = None):
        self.config = config
        # Phases of bringing this engine up (resolve, load weights, KV cache, ...): fw.warm.startup.
        self.startup_report = startup.begin()
        if not str(config.device).startswith("cuda"):
            tune_malloc()  # before loading: activations then reuse heap blocks instead of page-faulting
            spare_old_objects()  # release_load_memory's collection then looks at the load's objects only
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        self.plugins = engine_plugins(config, plugins)
        if config.enable_torch_compile:  # refused modes fail before any weight is read
            from fw.compile.modes import check_compile_mode  # here: fw.compile's import costs start-up time

            check_compile_mode(config.compile_mode, resolve_device(config.device).type)
        # --speculative-config: a bad method or option fails here, before any weight is read
        spec_config = SpeculativeConfig.parse(config.speculative_config)
        self.speculator = Speculator(spec_config, self.plugins.registry("proposer")) if spec_config else None
        # --tensor-parallel-size > 1: the other ranks started and joined, this process is rank 0 (fw.distributed)
        self.cluster = Cluster.start(config, self.plugins)
        with loading_threads():  # fewer threads while a neighbour holds a core: no copy waits at a barrier
            loaded = self.loaded = load_model(config, self.plugins, self.cluster.tp if self.cluster else None)
        self.tokenizer = loaded.tokenizer
        self.max_length = loaded.max_length
        self.vocab_size = loaded.hf_config.vocab_size
        # --task embed: prompts' hidden states pooled into embeddings (fw.pooling). A pooling that reads every
        # prompt position turns prefix caching off: a cache hit skips computing the positions it covers.
        self.pooling = engine_pooling(config, loaded)
        caching = config.enable_prefix_caching and not (self.pooling and self.pooling.method in READS_EVERY_POSITION)
        page = config.kv_cache_page_size
        with startup.phase(startup.ALLOCATE_KV_CACHE):
            # what this rank's budget holds; with other ranks, the smallest any of them holds (fw.distributed)
            own = kv_cache.page_budget(config, loaded, page)
            num_blocks = self.cluster.agree_pages(own) if self.cluster is not None else own.require()
            self.blocks = PageManager(num_blocks, page, caching)
            self.runner = ModelRunner(loaded.model, loaded.attention.chosen.backend_cls, num_blocks, page,
                                      loaded.dtype, loaded.device)
            if self.cluster is not None:  # the workers follow every forward step
                self.cluster.drive(self.runner)
        # --enable-lora: adapters on the base model's linear layers, named per request (fw.lora)
        self.lora = self._start_lora(config, loaded)
        release_load_memory(trim=loaded.device.type == "cpu")
        self.scheduler = Scheduler(self.blocks, config.max_batch_size, config.step_tokens, config.chunk_size)
        self.scheduler.max_loras = config.max_loras if self.lora is not None else None  # adapters per batch
        self.sampler = SamplerPipeline(self.plugins.registry("sampler"), config.sampling_backend)
        self.grammar = GrammarService(self.plugins.registry("grammar_backend"),
                                      GrammarTokenizer(self.tokenizer, self.vocab_size, loaded.eos_token_ids),
                                      config.grammar_backend, enabled=config.enable_structured_output)
        if self.speculator is not None:
            self.speculator.start(ProposerContext(
                self.vocab_size, frozenset(loaded.eos_token_ids), spec_config.num_speculative_tokens,
                loaded.device, self.tokenizer, config, self.plugins))
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        logger.info("KV cache: %d pages of %d tokens (%d tokens)", num_blocks, page, num_blocks * page)
        if config.enable_torch_compile:  # fw.compile: the runner's step compiled per bucket, warmed up here
            from fw.compile.engine_step import attach  # here: torch.compile's modules cost start-up time

            attach(self)

    def _start_lora(self, config: EngineConfig, loaded):
        if not config.enable_lora:
            return None
        from fw.lora.manager import LoRAManager, parse_lora_modules  # here: only LoRA engines pay for it

        in_use = lambda: {r.lora_name for r in getattr(self, "requests", {}).values()}  # noqa: E731 (none at start)
        lora = LoRAManager(loaded.model, config.max_loras, config.max_lora_rank, loaded.dtype, loaded.device,
                           config.max_cpu_loras, in_use)
        for name, path in parse_lora_modules(config.lora_modules):
            lora.add(name, path)
        self.runner.lora = lora
        return lora

    # -- requests ------------------------------------------------------------------------

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt).input_ids

    def add_request(
        self,
        request_id: str | None = None,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        params: SamplingParams | None = None,
        delta: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> Request:
        if self.pooling is not None or isinstance(params, PoolingParams):
            return self._add_embedding_request(request_id, prompt, prompt_token_ids, params)
        params = params or SamplingParams()
        request_id, ids = request_id_and_ids(self.requests, self.new_request_id, self.tokenize, request_id, prompt,
                                             prompt_token_ids)
        self._validate_prompt(ids, params)
        self._validate_token_params(params)
        self._validate_speculation(params)
        if params.max_tokens is None:
            # A copy: the caller's params may be shared by prompts of other lengths.
            params = dataclasses.replace(params, max_tokens=self.max_sequence_tokens - len(ids))
        grammar = None
        if params.structured_outputs is not None:  # compile errors refuse the request here
            grammar = self.grammar.new_grammar(params.structured_outputs)
        req = Request(request_id, prompt, ids, params, delta=delta)
        if lora_request is not None:
            self._attach_lora(req, lora_request)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]
        for i in range(params.n):
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.loaded.device).manual_seed(params.seed + i)
            detok = IncrementalDetokenizer(self.tokenizer, ids, params.stop, params.skip_special_tokens,
                                           params.include_stop_str_in_output)
            seq = Sequence(req, i, params, list(ids), len(ids), detok, generator)
            if grammar is not None:
                backend, compiled, compiler = grammar
                seq.grammar = SequenceGrammar(backend, compiler, compiled.matcher())
            if params.logprobs is not None:
                seq.logprobs = []
            req.seqs.append(seq)
            self.scheduler.add(seq)
        self.requests[request_id] = req
        return req

    def _add_embedding_request(self, request_id: str | None, prompt: str | None, prompt_token_ids: list[int] | None,
                               params: PoolingParams | None) -> Request:
        """An embedding request (--task embed): one sequence whose prompt is scheduled, chunked and batched as
        any other, its hidden states pooled as they come (fw.pooling) and nothing sampled."""
        name = self.loaded.source.name
        if self.pooling is None:
            raise InvalidRequestError(f"{name} is served for text generation; start it with --task embed to serve "
                                      f"embeddings from it")
        if params is not None and not isinstance(params, PoolingParams):
            raise InvalidRequestError(f"{name} is served for embeddings (--task embed), not text generation")
        params = params or PoolingParams()
        request_id, ids = request_id_and_ids(self.requests, self.new_request_id, self.tokenize, request_id, prompt,
                                             prompt_token_ids, missing="give an input text or token ids",
                                             param="input")
        self._validate_prompt(ids, _PREFILL_ONLY)
        self.pooling.check_dimensions(params.dimensions, name)
        req = Request(request_id, prompt, ids, _PREFILL_ONLY, pooling=PoolingState(self.pooling.method, params))
        req.seqs.append(Sequence(req, 0, _PREFILL_ONLY, list(ids), len(ids), None))
        self.scheduler.add(req.seqs[0])
        self.requests[request_id] = req
        return req

    # -- LoRA adapters (fw.lora, docs/lora.md) ------------------------------------------------

    def _attach_lora(self, req: Request, lora: LoRARequest) -> None:
        """Run `req` with the adapter: loaded now if it is new and has a path; an unknown name is a 404."""
        manager = self._lora_manager()
        if lora.name not in manager.registered and lora.path:
            manager.add(lora.name, lora.path)
        req.lora_name, req.cache_salt = lora.name, manager.acquire(lora.name)

    def _lora_manager(self):
        if self.lora is None:
            raise InvalidRequestError("this engine serves no LoRA adapters; start it with --enable-lora", param="model")
        return self.lora

    def add_lora(self, name: str, path: str) -> None:
        self._lora_manager().add(name, path)

    def remove_lora(self, name: str) -> None:
        """Unload an adapter no request is running with."""
        users = sum(1 for r in self.requests.values() if r.lora_name == name)
        if users:
            raise InvalidRequestError(f"LoRA adapter {name!r} is in use by {users} request(s); unload it once they "
                                      f"finish", param="lora_name")
        self._lora_manager().remove(name)

    @property
    def max_sequence_tokens(self) -> int:
        """Longest sequence one request can reach: --max-length, or less when the whole KV cache
        holds less. A request without max_tokens runs up to it (rather than being refused because
        a full --max-length sequence would not fit)."""
        return min(self.max_length, self.blocks.num_blocks * self.blocks.page_size)

    def _validate_prompt(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise InvalidRequestError("the prompt is empty; give at least one token", param="prompt")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"prompt token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})", param="prompt")
        n, limit = len(ids), self.max_length
        if n >= limit:
            raise PromptTooLongError(
                f"the prompt has {n} tokens, but this engine serves at most {limit} tokens per sequence "
                f"(prompt + output); shorten the prompt", param="prompt")
        if params.max_tokens is not None and n + params.max_tokens > limit:
            raise PromptTooLongError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {n + params.max_tokens} exceeds the "
                f"maximum length {limit}; lower max_tokens to at most {limit - n}", param="max_tokens")
        capacity = self.blocks.num_blocks * self.blocks.page_size
        if params.max_tokens is None:
            if n >= capacity:
                raise PromptTooLongError(
                    f"the prompt has {n} tokens but the whole KV cache holds {capacity}; shorten the prompt or "
                    f"start the engine with a larger --kv-cache-memory", param="prompt")
        elif n + params.max_tokens > capacity:
            raise PromptTooLongError(
                f"the request needs up to {n + params.max_tokens} tokens of KV cache but the whole cache holds "
                f"{capacity}; lower max_tokens or start the engine with a larger --kv-cache-memory",
                param="max_tokens")

    def _validate_token_params(self, params: SamplingParams) -> None:
        """Token ids in sampling params must be in the vocabulary: the sampler stages index logits
        with them (an unknown stop token would crash a step in the min_tokens stage)."""
        for name, ids in (("logit_bias", list(params.logit_bias or {})), ("stop_token_ids", params.stop_token_ids),
                          ("allowed_token_ids", params.allowed_token_ids or [])):
            bad = [t for t in ids if not 0 <= int(t) < self.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"{name}: token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})", param=name)
        self.sampler.validate(params, self.tokenizer)  # per-request samplers: known names, valid parameters

    def _validate_speculation(self, params: SamplingParams) -> None:
        """A request's speculative_config against this engine's --speculative-config (fw.speculative)."""
        if params.speculative_config is None:
            return
        if self.speculator is None:
            raise InvalidRequestError("speculative_config: this engine does not speculate; drop it, or start the "
                                      "engine with --speculative-config", param="speculative_config")
        self.speculator.check_request(params)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its pages; returns its final output (finish_reason "abort")."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        for seq in req.seqs:
            if not seq.finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
                if self.speculator is not None:
                    self.speculator.release(seq)
        return self._output(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- the step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if self.speculator is not None:  # drafts for this step (fw.speculative), verified below
            self.speculator.propose(self.scheduler.running, self.max_length)
        batch = self.scheduler.schedule()
        if not batch:
            return []
        result = self.runner.execute(batch.seqs, batch.num_new_tokens)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if seq.draft_token_ids:
                continue  # a verify pass: what its draft keeps sets its computed tokens (_verify)
            seq.num_computed_tokens += n
            self.blocks.commit_full_blocks(seq)
        for seq, first, logits in result.prompt_logits:
            self._add_prompt_logprobs(seq, first, logits)
        touched: dict[str, Request] = {}
        for seq, first, rows in result.pool_rows:  # embedding requests: pooled; done at the prompt's end
            seq.request.pooling.add(first, rows)
            if first + rows.shape[0] == seq.num_prompt_tokens:
                self._finish(seq, "stop")
                touched[seq.request.request_id] = seq.request
        if result.sample_seqs:
            seqs = result.sample_seqs
            drafting = any(s.draft_token_ids for s in seqs)
            rows = _sampling_rows(seqs) if drafting else seqs
            sampling = SamplingBatch(rows, self.vocab_size, self.loaded.device, self.loaded.eos_token_ids)
            if drafting:
                grammar_mask = self.grammar.fill_bitmask_with_drafts([s.grammar for s in seqs],
                                                                     [s.draft_token_ids for s in seqs])
                keep, rewinds = self._verify_inputs(seqs, result.sample_logits, grammar_mask)
            else:
                grammar_mask = self.grammar.fill_bitmask([s.grammar for s in seqs])
                keep, rewinds = None, {}
            sampled = self.sampler.sample(result.sample_logits, sampling, grammar_mask, keep)
            now = time.monotonic()
            row = 0
            for seq in seqs:
                width = 1 + len(seq.draft_token_ids)
                req = seq.request
                touched[req.request_id] = req
                if seq.params.max_tokens == 0:  # prompt-only request (e.g. echo + prompt logprobs)
                    self._finish(seq, "length")
                elif width > 1:
                    if req.first_token_time is None:
                        req.first_token_time = now
                    self._verify(seq, row, rows[row:row + width], sampled, keep, rewinds.get(seq.seq_id))
                else:
                    if req.first_token_time is None:
                        req.first_token_time = now
                    token = sampled.token_ids[row]
                    if seq.grammar is None or self._grammar_accepts(seq, token):
                        self._append(seq, token, sampled.logprobs[row])
                row += width
        outputs = []
        for req in touched.values():
            outputs.append(self._output(req))
            if req.finished:
                self.requests.pop(req.request_id, None)
        return outputs

    # -- speculative decoding: verifying a draft (fw.speculative, docs/speculative.md) -------

    def _verify_inputs(self, seqs: list[Sequence], logits: torch.Tensor, grammar_mask) -> tuple[list[int], dict]:
        """Before sampling a step with drafts: the rows whose processed logits a sampled draft (one with
        probabilities) is checked against, and for each seeded sequence with a deterministic draft what
        rewinding its generator needs (its state, its rows' logits and grammar mask as they are now)."""
        keep: list[int] = []
        rewinds: dict[int, tuple] = {}
        row = 0
        for seq in seqs:
            width = 1 + len(seq.draft_token_ids)
            if width > 1 and seq.draft_probs is not None:
                keep.extend(range(row, row + width))
            elif width > 1 and seq.generator is not None:
                mask = None
                if grammar_mask is not None and seq.grammar is not None:
                    bitmask, mask_rows = grammar_mask
                    at = mask_rows.index(row)
                    mask = (bitmask[at:at + width].clone(), list(range(width)))
                rewinds[seq.seq_id] = (seq.generator.get_state(), logits[row:row + width].clone(), mask)
            row += width
        return keep, rewinds

    def _verify(self, seq: Sequence, row: int, rows: list, sampled, keep: list[int], rewind) -> None:
        """Keep what the rejection rule accepts of seq's draft, emit it and the token after it, and give
        back the KV pages of the rejected positions."""
        draft = seq.draft_token_ids
        k = len(draft)
        tokens = sampled.token_ids[row:row + k + 1]
        logprobs = sampled.logprobs[row:row + k + 1]
        if seq.draft_probs is not None:  # a sampled draft: min(1, p/q), on the fully processed p
            at = keep.index(row)
            processed = sampled.processed[at:at + k + 1]
            if seq.params.greedy:
                p = torch.nn.functional.one_hot(processed.argmax(dim=-1), processed.shape[-1]).float()
            else:
                p = processed.softmax(dim=-1)
            emitted, accepted = verify(p, draft, seq.draft_probs[:k].to(p.device), seq.generator)
            if seq.logprobs is not None:  # the pipeline's entries name its own draw; rebuild where it differs
                logprobs = [lp if t == tokens[j] else token_logprobs(sampled.raw_logprobs[row + j], t,
                                                                     seq.params.logprobs)
                            for j, (t, lp) in enumerate(zip(emitted, logprobs))]
        else:  # a deterministic draft: the target's own draw at each position decides (rejection.py)
            accepted = accepted_prefix(tokens, draft)
            emitted = tokens[:accepted + 1]
            if rewind is not None and accepted < k:
                self._rewind_generator(seq, rows[:accepted + 1], rewind)
        self.speculator.record(seq, k, accepted)
        seq.draft_token_ids, seq.draft_probs = [], None
        # KV holds the last token and every draft token; the accepted ones are valid
        seq.num_computed_tokens = seq.num_tokens + accepted
        for token, lp in zip(emitted, logprobs):
            if seq.grammar is not None and not self._grammar_accepts(seq, token):
                return
            self._append(seq, token, lp)
            if seq.finished:  # EOS, a stop string or max_tokens cut the accepted run
                return
        self.blocks.truncate(seq, seq.num_computed_tokens)
        self.blocks.commit_full_blocks(seq)

    def _rewind_generator(self, seq: Sequence, rows: list, rewind) -> None:
        """A seeded sequence drew random numbers at every draft position, the rejected ones too. Draw
        again from the state before the step over just the positions whose tokens it emits, so it has
        drawn what a step without speculation would have: its output then does not depend on whether
        its steps speculated."""
        state, logits, mask = rewind
        n = len(rows)
        seq.generator.set_state(state)
        if mask is not None:
            mask = (mask[0][:n], mask[1][:n])
        batch = SamplingBatch(rows, self.vocab_size, self.loaded.device, self.loaded.eos_token_ids)
        self.sampler.sample(logits[:n], batch, mask)

    def _add_prompt_logprobs(self, seq: Sequence, first: int, logits: torch.Tensor) -> None:
        req = seq.request
        logprobs = torch.log_softmax(logits, dim=-1)
        top = seq.params.prompt_logprobs
        # A sequence preempted mid-prefill recomputes its prompt from the start: skip positions it has.
        for r in range(max(0, len(req.prompt_logprobs) - first), logprobs.shape[0]):
            req.prompt_logprobs.append(token_logprobs(logprobs[r], seq.token_ids[first + r], top))
        if first + logprobs.shape[0] >= seq.num_prompt_tokens:
            req.prompt_logprobs_done = True
            self._decode_logprob_tokens(req.prompt_logprobs)

    def _append(self, seq: Sequence, token: int, logprobs) -> None:
        p = seq.params
        seq.token_ids.append(token)
        if logprobs is not None:
            self._decode_logprob_tokens([logprobs])
            seq.logprobs.append(logprobs)
            seq.cumulative_logprob += logprobs[token].logprob
        n_out = seq.num_output_tokens
        can_stop = n_out >= p.min_tokens
        stop_str = seq.detokenizer.add_token(token, find_stop=can_stop)
        if can_stop and token in self.loaded.eos_token_ids and not p.ignore_eos:
            return self._finish(seq, "stop")
        if can_stop and token in p.stop_token_ids:
            return self._finish(seq, "stop", token)
        if stop_str is not None:
            return self._finish(seq, "stop", stop_str)
        if n_out >= p.max_tokens or seq.num_tokens >= self.max_length:
            self._finish(seq, "length")

    def _grammar_accepts(self, seq: Sequence, token: int) -> bool:
        """Advance the sequence's matcher. A token the grammar refuses (only possible if a backend's
        mask and its matcher disagree) ends the sequence instead of producing output that breaks
        the constraint; a stop token after the grammar's end still stops it normally."""
        matcher = seq.grammar.matcher
        if matcher.accept_token(token) or (token in self.loaded.eos_token_ids and matcher.is_terminated()):
            return True
        logger.error("grammar backend %s refused token %d that its mask allowed; ending sequence %d of %s",
                     seq.grammar.backend, token, seq.index, seq.request.request_id)
        self._finish(seq, "stop")
        return False

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.scheduler.finish(seq)
        if self.speculator is not None:
            self.speculator.release(seq)

    def _decode_logprob_tokens(self, entries) -> None:
        for entry in entries:
            if entry is None:
                continue
            for token_id, lp in entry.items():
                if lp.decoded_token is None:
                    lp.decoded_token = self.tokenizer.decode([token_id])

    def _output(self, req: Request) -> RequestOutput | EmbeddingRequestOutput:
        if req.pooling is not None:
            return self._embedding_output(req)
        outs = []
        for seq in req.seqs:
            text = seq.detokenizer.visible_text(seq.finished)
            ids = seq.output_token_ids
            logprobs = seq.logprobs
            if req.delta:
                text, ids = text[seq.sent_text_len:], ids[seq.sent_token_len:]
                logprobs = logprobs[seq.sent_token_len:] if logprobs is not None else None
                seq.sent_text_len += len(text)
                seq.sent_token_len += len(ids)
            outs.append(CompletionOutput(
                seq.index, text, list(ids), logprobs,
                seq.cumulative_logprob if seq.logprobs is not None else None,
                seq.finish_reason, seq.stop_reason,
            ))
        metrics = {"arrival_time": req.arrival_time}
        if req.first_token_time is not None:
            metrics["first_token_time"] = req.first_token_time
        states = [s.speculation for s in req.seqs if s.speculation is not None]
        if states:  # speculative decoding: this request's drafts
            metrics["spec_num_drafts"] = sum(st.num_drafts for st in states)
            metrics["spec_num_draft_tokens"] = sum(st.num_draft_tokens for st in states)
            metrics["spec_num_accepted_tokens"] = sum(st.num_accepted_tokens for st in states)
        return RequestOutput(
            req.request_id, req.prompt, req.prompt_token_ids, outs, req.finished,
            req.prompt_logprobs, max(s.num_cached_tokens for s in req.seqs), metrics,
        )

    def _embedding_output(self, req: Request) -> EmbeddingRequestOutput:
        seq, state = req.seqs[0], req.pooling
        output = None
        if seq.finish_reason == "stop":
            vector = state.result(seq.num_prompt_tokens)[None]
            output = EmbeddingOutput(finish(vector, self.pooling, [state.params.dimensions])[0].tolist())
        return EmbeddingRequestOutput(req.request_id, req.prompt, req.prompt_token_ids, output, req.finished,
                                      {"arrival_time": req.arrival_time})

    # -- statistics ----------------------------------------------------------------------

    def stats(self) -> dict:
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_cache_usage": self.blocks.usage,
            "num_kv_blocks": self.blocks.num_blocks,
            "prefix_cache_queried_tokens": self.blocks.stats.queried_tokens,
            "prefix_cache_hit_tokens": self.blocks.stats.hit_tokens,
            "num_preemptions": self.scheduler.num_preemptions,
            # graphs torch.compile built (or loaded) for this engine: constant after warm-up (fw.compile)
            "num_compilations": self.runner.compiled.num_compiles if self.runner.compiled is not None else 0,
            **(self.speculator.stats.as_dict() if self.speculator is not None else {}),
        }


class _DraftPosition:
    """Sequence `seq` as it would stand after accepting its first `j` draft tokens: what the sampler
    stages see at the verify row of draft position j (penalties, min_tokens and the like count the
    draft tokens before it). Other attributes are the sequence's."""

    def __init__(self, seq: Sequence, j: int):
        self.seq = seq
        self.token_ids = seq.token_ids + seq.draft_token_ids[:j]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.seq.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.seq.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def __getattr__(self, name: str):
        if name == "seq":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.seq, name)


def _sampling_rows(seqs: list[Sequence]) -> list:
    """The sampled rows of a step with drafts: each sequence, then a view of it after each draft token."""
    rows: list = []
    for seq in seqs:
        rows.append(seq)
        rows.extend(_DraftPosition(seq, j) for j in range(1, len(seq.draft_token_ids) + 1))
    return rows
