"""POST /v1/completions: prompts as text or token ids, n, logprobs, echo with
prompt logprobs (lm-eval-harness's loglikelihood), streaming with usage."""

from __future__ import annotations

from fastapi import APIRouter, Request

from fw.errors import InvalidRequestError
from fw.server.convert import CompletionLogprobs, sampling_params
from fw.server.limits import RANGES, check_limits
from fw.server.openapi import error_responses
from fw.server.prompts import text_prompt_ids
from fw.server.protocol import CompletionRequest, new_id, now
from fw.server.routes.embeddings import require_task
from fw.server.state import ServerState
from fw.server.streaming import merged, respond, sse

router = APIRouter()


def _prompt_list(prompt) -> list[str | list[int]]:
    """The request's prompts, each a string or a non-empty list of token ids (checked here, cheaply,
    before the request is admitted)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidRequestError("prompt must not be empty", param="prompt")
    prompts = [list(prompt)] if all(isinstance(p, int) for p in prompt) else list(prompt)
    for p in prompts:
        if not (isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(t, int) for t in p))):
            raise InvalidRequestError("each prompt must be a non-empty string or a non-empty list of token ids",
                                      param="prompt")
    return prompts


async def _tokenized(state: ServerState, prompts: list[str | list[int]]) -> list[tuple[str | None, list[int]]]:
    return [(p, await text_prompt_ids(state, p)) if isinstance(p, str) else (None, p) for p in prompts]


@router.post("/v1/completions", responses=error_responses(400, 401, 404, 413, 429, 500, 503))
async def create_completion(req: CompletionRequest, request: Request):
    state: ServerState = request.app.state.fw
    model = state.model_name(req.model)
    state.note_ignored(req)
    require_task(state, "generate", "/v1/completions")
    if req.suffix:
        raise InvalidRequestError("suffix is not supported: this server does not do fill-in-the-middle",
                                  param="suffix")
    if req.echo and not state.config.enable_echo:
        raise InvalidRequestError("echo is turned off on this server (--no-enable-echo); send the request without "
                                  "echo, or start fw with --enable-echo", param="echo")
    if req.best_of is not None and req.best_of != req.n:
        raise InvalidRequestError("best_of is not supported; use n", param="best_of")
    check_limits(req, RANGES, state.vocab_size)
    prompt_list = _prompt_list(req.prompt)
    prompt_logprobs = req.logprobs if (req.echo and req.logprobs is not None) else None
    params = sampling_params(req, req.max_tokens, req.logprobs, prompt_logprobs)
    with state.admission() as permit:  # before tokenizing: a busy server refuses at once
        prompts = await _tokenized(state, prompt_list)
        request_id = new_id("cmpl")
        job = _Completion(state, req, model, request_id, prompts)
        return await respond(state, request, permit, req.stream, prompts, params, request_id, job,
                             state.lora_request(model))


class _Completion:
    def __init__(self, state: ServerState, req: CompletionRequest, model: str, request_id: str,
                 prompts: list[tuple[str | None, list[int]]]):
        self.state, self.req, self.model, self.id = state, req, model, request_id
        self.prompts = prompts
        self.created = now()
        tok = state.tokenizer
        n = req.n
        self.texts = {p * n + i: "" for p in range(len(prompts)) for i in range(n)}
        self.logprobs = {k: CompletionLogprobs(tok) for k in self.texts}
        self.finish = {k: None for k in self.texts}
        self.completion_tokens = 0
        self.echoed: set[int] = set()
        self.finish_sent: set[int] = set()

    def _echo(self, p: int, index: int, out) -> str:
        """The prompt's text (and its logprobs) before a choice's first output, with echo."""
        if not self.req.echo or index in self.echoed:
            return ""
        self.echoed.add(index)
        text, ids = self.prompts[p]
        text = text if text is not None else self.state.tokenizer.decode(ids)
        if self.req.logprobs is not None:
            entries = out.prompt_logprobs or [None] * len(ids)
            for token_id, entry in zip(ids, entries):
                self.logprobs[index].add(token_id, entry, self.req.logprobs)
        return text

    def _absorb(self, p: int, out) -> list[tuple[int, str]]:
        """Fold one delta output in; returns (choice index, new text) per choice."""
        news = []
        for c in out.outputs:
            index = p * self.req.n + c.index
            text = self._echo(p, index, out) + c.text
            if self.req.logprobs is not None and c.logprobs:
                self.logprobs[index].offset = len(self.texts[index]) + len(text) - len(c.text)
                for token_id, entry in zip(c.token_ids, c.logprobs):
                    self.logprobs[index].add(token_id, entry, self.req.logprobs)
            self.texts[index] += text
            self.completion_tokens += len(c.token_ids)
            if c.finish_reason is not None:
                self.finish[index] = c.finish_reason
            news.append((index, text))
        return news

    def usage(self) -> dict:
        prompt_tokens = sum(len(ids) for _, ids in self.prompts)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": prompt_tokens + self.completion_tokens}

    async def collect(self, streams) -> dict:
        async for p, out in merged(self.state, streams, [len(ids) for _, ids in self.prompts]):
            self._absorb(p, out)
        choices = [{
            "index": k, "text": self.texts[k],
            "logprobs": self.logprobs[k].as_dict() if self.req.logprobs is not None else None,
            "finish_reason": self.finish[k],
        } for k in sorted(self.texts)]
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage()}

    async def events(self, streams):
        async for p, out in merged(self.state, streams, [len(ids) for _, ids in self.prompts]):
            for index, text in self._absorb(p, out):
                # With n > 1 a finished choice stays in its request's later outputs: announce its
                # finish once, not again with every other choice's tokens.
                if index in self.finish_sent or (not text and self.finish[index] is None):
                    continue
                if self.finish[index] is not None:
                    self.finish_sent.add(index)
                choice = {"index": index, "text": text,
                          "logprobs": self.logprobs[index].take() if self.req.logprobs is not None else None,
                          "finish_reason": self.finish[index]}
                yield sse({"id": self.id, "object": "text_completion", "created": self.created,
                           "model": self.model, "choices": [choice]})
        if self.req.stream_options and self.req.stream_options.include_usage:
            yield sse({"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                       "choices": [], "usage": self.usage()})
