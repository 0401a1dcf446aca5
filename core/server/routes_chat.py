"""POST /v1/chat/completions: messages through the model's chat template,
n, logprobs + top_logprobs, streaming (role delta first, content deltas,
finish_reason, usage chunk)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from fw.chat import render_chat
from fw.errors import InvalidRequestError
from fw.server.convert import chat_logprobs, sampling_params
from fw.server.protocol import ChatCompletionRequest, ChatMessage, new_id, now
from fw.server.state import ServerState
from fw.server.streaming import merged, respond, sse

router = APIRouter()


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """OpenAI messages -> the plain dicts chat templates expect; text parts are joined."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InvalidRequestError(
                        f"messages[{i}].content: only text parts are supported, got {part.get('type')!r}",
                        param="messages")
                texts.append(part["text"])
            content = "".join(texts)
        entry = {"role": m.role, "content": content or ""}
        if m.name:
            entry["name"] = m.name
        out.append(entry)
    return out


@router.post("/v1/chat/completions")
async def create_chat_completion(req: ChatCompletionRequest, request: Request):
    state: ServerState = request.app.state.fw
    model = state.model_name(req.model)
    state.note_ignored(req)
    if req.response_format is not None and req.response_format.type != "text":
        raise InvalidRequestError(
            f"response_format {req.response_format.type!r} needs a grammar backend; none is installed "
            f"(structured output arrives with the grammar-backend plugins)", param="response_format")
    if req.tools and req.tool_choice != "none":
        raise InvalidRequestError("tool calling is not supported yet; send the request without tools",
                                  param="tools")
    rendered = render_chat(state.tokenizer, message_dicts(req.messages), req.add_generation_prompt,
                           req.chat_template_kwargs)
    top = req.top_logprobs or 0
    if top and not req.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    max_tokens = req.max_completion_tokens or req.max_tokens
    params = sampling_params(req, max_tokens, top if req.logprobs else None)
    request_id = new_id("chatcmpl")
    prompt = [(rendered["prompt"], rendered["prompt_token_ids"])]
    job = _Chat(state, req, model, request_id, len(rendered["prompt_token_ids"]), top)
    return await respond(state, request, req.stream, prompt, params, request_id, job)


class _Chat:
    def __init__(self, state: ServerState, req: ChatCompletionRequest, model: str, request_id: str,
                 prompt_tokens: int, top: int):
        self.state, self.req, self.model, self.id = state, req, model, request_id
        self.prompt_tokens = prompt_tokens
        self.top = top
        self.created = now()
        self.texts = {i: "" for i in range(req.n)}
        self.token_ids: dict[int, list[int]] = {i: [] for i in range(req.n)}
        self.entries: dict[int, list] = {i: [] for i in range(req.n)}
        self.finish: dict[int, str | None] = {i: None for i in range(req.n)}

    def _chunk(self, choices: list[dict]) -> str:
        return sse({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                    "model": self.model, "choices": choices})

    def _logprobs(self, token_ids: list[int], entries: list) -> dict | None:
        if not self.req.logprobs:
            return None
        return chat_logprobs(token_ids, entries, self.top, self.state.tokenizer)

    def usage(self) -> dict:
        completion = sum(len(t) for t in self.token_ids.values())
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    async def collect(self, streams) -> dict:
        async for _, out in merged(self.state, streams, [self.prompt_tokens]):
            for c in out.outputs:
                self.texts[c.index] += c.text
                self.token_ids[c.index] += c.token_ids
                self.entries[c.index] += c.logprobs or []
                self.finish[c.index] = c.finish_reason or self.finish[c.index]
        choices = [{
            "index": i, "message": {"role": "assistant", "content": self.texts[i]},
            "logprobs": self._logprobs(self.token_ids[i], self.entries[i]),
            "finish_reason": self.finish[i],
        } for i in range(self.req.n)]
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage()}

    async def events(self, streams):
        for i in range(self.req.n):
            yield self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}])
        async for _, out in merged(self.state, streams, [self.prompt_tokens]):
            for c in out.outputs:
                self.token_ids[c.index] += c.token_ids
                if c.text:
                    yield self._chunk([{"index": c.index, "delta": {"content": c.text},
                                        "logprobs": self._logprobs(c.token_ids, c.logprobs or []),
                                        "finish_reason": None}])
                elif c.token_ids and self.req.logprobs:  # tokens without text yet (a split character)
                    yield self._chunk([{"index": c.index, "delta": {},
                                        "logprobs": self._logprobs(c.token_ids, c.logprobs or []),
                                        "finish_reason": None}])
                if c.finish_reason is not None:
                    yield self._chunk([{"index": c.index, "delta": {}, "logprobs": None,
                                        "finish_reason": c.finish_reason}])
        if self.req.stream_options and self.req.stream_options.include_usage:
            yield sse({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                       "model": self.model, "choices": [], "usage": self.usage()})
