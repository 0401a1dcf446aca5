"""`LLM`: the library front, in the shape vLLM users know.

    from fw import LLM, SamplingParams
    llm = LLM(model="path/or/hub-id", dtype="float32", max_batch_size=32)
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=20, temperature=0))
    print(outs[0].outputs[0].text)

    embedder = LLM(model="path/to/all-MiniLM-L6-v2")     # an encoder, or a decoder with task="embed"
    vectors = [o.outputs.embedding for o in embedder.embed(["Hello", "Hi there"])]

Keyword options are the engine flags' names (`kv_cache_page_size=16`, ...).
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

from fw.chat import render_chat
from fw.config import resolve_config
from fw.engine.factory import create_engine
from fw.engine.outputs import EmbeddingRequestOutput, RequestOutput
from fw.lora.request import LoRARequest
from fw.plugins.manager import PluginManager
from fw.pooling.params import PoolingParams
from fw.sampling.params import SamplingParams

Prompt = str | list[int] | dict[str, Any]


class LLM:
    def __init__(self, model: str | None = None, *, plugins: PluginManager | None = None, **options: Any):
        # The library takes options as arguments only; FW_* variables are for the CLI and server.
        self.config = resolve_config(environ={}, model=model, **options)
        # LLMEngine for causal LMs; fw.pooling's EncoderEngine for encoder-only models (embeddings)
        self.engine = create_engine(self.config, plugins)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_info(self) -> dict[str, Any]:
        """What runs the model, from the engine plan (fw.plan): `architecture` (the fw plugin's name),
        `hf_architectures`, `plugin` and `distribution` (who registered it), `attention_backend`,
        `quantization` (None: dense weights), `moe_kernel`, `device`, `dtype`, `kv_cache_dtype`,
        `max_length`, `task`. `llm.engine.loaded.plan` holds every decision with its candidates."""
        return {**self.engine.loaded.plan.summary(), "task": self.engine.config.task}

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run all prompts together (continuously batched); outputs come back in prompt order.

        A prompt is a string, a list of token ids, or {"prompt": ...} / {"prompt_token_ids": [...]}.
        `lora_request` runs them with a LoRA adapter (one for all, or one per prompt; None: the base
        model), on an engine made with enable_lora=True."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        loras = (list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts))
        if len(loras) != len(prompts):
            raise ValueError(f"{len(loras)} LoRA requests for {len(prompts)} prompts")
        ids: list[str] = []
        try:
            for prompt, sp, lora in zip(prompts, params, loras):
                ids.append(self._add(prompt, sp, lora_request=lora))
        except Exception:
            for request_id in ids:  # all or nothing: no prompt before the rejected one stays queued
                self.engine.abort_request(request_id)
            raise
        return self._run(ids)

    def embed(self, prompts: Prompt | Sequence[Prompt],
              pooling_params: PoolingParams | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (a string, a list of token ids, or {"prompt": ...} /
        {"prompt_token_ids": [...]}), in prompt order: `outputs.embedding` is a list of floats.

        The model must embed: an encoder-only model, or a decoder loaded with task="embed"."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        texts = [i for i, p in enumerate(prompts) if isinstance(p, str)]
        ids: dict[int, list[int]] = {}
        if texts:  # one batched call: the Rust tokenizer splits a list on all cores
            encoded = self.tokenizer([prompts[i] for i in texts]).input_ids
            ids = dict(zip(texts, encoded))
        request_ids: list[str] = []
        try:
            for i, prompt in enumerate(prompts):
                if i in ids:
                    request_ids.append(self.engine.add_request(prompt=prompt, prompt_token_ids=ids[i],
                                                               params=pooling_params or PoolingParams()).request_id)
                else:
                    request_ids.append(self._add(prompt, pooling_params or PoolingParams()))
        except Exception:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise
        return self._run(request_ids)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c, add_generation_prompt, chat_template_kwargs) for c in conversations]
        return self.generate(prompts, sampling_params, lora_request)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template_kwargs: dict | None = None) -> dict[str, Any]:
        return render_chat(self.tokenizer, messages, add_generation_prompt, chat_template_kwargs)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
               lora_request: LoRARequest | None = None) -> Iterator[RequestOutput]:
        """Yield one request's outputs as they grow; each carries only the new text and tokens.

        Closing the generator early aborts the request and frees its KV pages."""
        request_id = self._add(prompt, sampling_params or SamplingParams(), delta=True, lora_request=lora_request)
        done = False
        try:
            while not done:
                for out in self.engine.step():
                    if out.request_id == request_id:
                        done = out.finished
                        # Any sequence's news counts: with n > 1 the others go on after one stops.
                        if done or any(c.text or c.token_ids for c in out.outputs):
                            yield out
        finally:
            if not done:
                self.engine.abort_request(request_id)

    def _add(self, prompt: Prompt, params: SamplingParams | PoolingParams, delta: bool = False,
             lora_request: LoRARequest | None = None) -> str:
        extra = {"lora_request": lora_request} if lora_request is not None else {}  # the encoder engine has none
        if isinstance(prompt, str):
            return self.engine.add_request(prompt=prompt, params=params, delta=delta, **extra).request_id
        if isinstance(prompt, dict):
            return self.engine.add_request(prompt=prompt.get("prompt"), prompt_token_ids=prompt.get("prompt_token_ids"),
                                           params=params, delta=delta, **extra).request_id
        return self.engine.add_request(prompt_token_ids=list(prompt), params=params, delta=delta, **extra).request_id

    def _run(self, request_ids: list[str]) -> list:
        pending = set(request_ids)
        final: dict[str, RequestOutput] = {}
        while pending:
            outputs = self.engine.step()
            # the encoder engine has no scheduler: its own has_work says whether anything waits
            if not outputs and not getattr(self.engine, "scheduler", self.engine).has_work():
                raise RuntimeError("engine has no work but requests are unfinished")  # a bug, never expected
            for out in outputs:
                if out.finished and out.request_id in pending:
                    final[out.request_id] = out
                    pending.discard(out.request_id)
        return [final[i] for i in request_ids]
