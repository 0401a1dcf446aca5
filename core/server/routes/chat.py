"""POST /v1/chat/completions: messages through the model's chat template,
n, logprobs + top_logprobs, streaming (role delta first, content deltas,
finish_reason, usage chunk), and tool calling (tools + tool_choice; the logic
is in fw.server.tools.plan)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from fw.errors import InvalidRequestError
from fw.grammar.contract import GrammarError
from fw.server.convert import chat_logprobs, sampling_params
from fw.server.limits import CHAT_RANGES, check_limits
from fw.server.openapi import error_responses
from fw.server.prompts import chat_prompt
from fw.server.protocol import ChatCompletionRequest, ChatMessage, new_id, now
from fw.server.routes.embeddings import require_task
from fw.server.state import ServerState
from fw.server.streaming import merged, respond, sse
from fw.server.tools.plan import ToolPlan, plan_tools, render_with_tools, tool_message_fields, tool_sampling_params

router = APIRouter()


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """OpenAI messages -> the plain dicts chat templates expect; text parts are joined, and an
    assistant's `tool_calls` and a tool result's `tool_call_id` pass through."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            content = "".join(_part_text(part, f"messages[{i}].content[{j}]") for j, part in enumerate(content))
        entry = {"role": m.role, "content": content or ""}
        if m.name:
            entry["name"] = m.name
        entry.update(tool_message_fields(m, i))
        out.append(entry)
    return out


def _part_text(part: dict, where: str) -> str:
    """A content part's text; the message says which part and what is wrong with it."""
    kind = part.get("type")
    if kind != "text":
        raise InvalidRequestError(f"{where}: only text parts are supported, got type {kind!r}", param="messages")
    if "text" not in part:
        raise InvalidRequestError(f'{where}: a text part needs a "text" field with its text', param="messages")
    if not isinstance(part["text"], str):
        raise InvalidRequestError(f'{where}: "text" must be a string, got {type(part["text"]).__name__}',
                                  param="messages")
    return part["text"]


@router.post("/v1/chat/completions", responses=error_responses(400, 401, 404, 413, 429, 500, 503))
async def create_chat_completion(req: ChatCompletionRequest, request: Request):
    state: ServerState = request.app.state.fw
    model = state.model_name(req.model)
    state.note_ignored(req)
    require_task(state, "generate", "/v1/chat/completions")
    check_limits(req, CHAT_RANGES, state.vocab_size)
    plan = plan_tools(req, state.plugins.registry("tool_parser"), state.engine_config.tool_call_parser,
                      getattr(state.tokenizer, "chat_template", None))
    messages = message_dicts(req.messages)
    top = req.top_logprobs or 0
    if top and not req.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    max_tokens = req.max_completion_tokens or req.max_tokens
    params = tool_sampling_params(req, plan, lambda r: sampling_params(r, max_tokens, top if req.logprobs else None))
    with state.admission() as permit:  # before rendering and tokenizing: a busy server refuses at once
        text, ids = await chat_prompt(state, lambda: render_with_tools(
            state.tokenizer, messages, plan, req.add_generation_prompt, req.chat_template_kwargs))
        request_id = new_id("chatcmpl")
        job = _Chat(state, req, model, request_id, len(ids), top, plan)
        try:
            return await respond(state, request, permit, req.stream, [(text, ids)], params, request_id, job,
                                 state.lora_request(model))
        except GrammarError as exc:
            if plan is None or not plan.constrains:
                raise
            raise InvalidRequestError(f"tools: a function's parameters schema cannot constrain the output: {exc}",
                                      param="tools") from None


class _Chat:
    def __init__(self, state: ServerState, req: ChatCompletionRequest, model: str, request_id: str,
                 prompt_tokens: int, top: int, plan: ToolPlan | None = None):
        self.state, self.req, self.model, self.id = state, req, model, request_id
        self.prompt_tokens = prompt_tokens
        self.top = top
        self.plan = plan
        # one tool-call stream per choice: generated text -> content / tool_calls deltas
        self.tool_streams = {i: plan.new_stream() for i in range(req.n)} if plan is not None else None
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
            "index": i, "message": self._message(i),
            "logprobs": self._logprobs(self.token_ids[i], self.entries[i]),
            "finish_reason": self._finish_reason(i, self.finish[i]),
        } for i in range(self.req.n)]
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage()}

    def _message(self, i: int) -> dict:
        if self.tool_streams is None:
            return {"role": "assistant", "content": self.texts[i]}
        stream = self.tool_streams[i]
        stream.feed(self.texts[i])
        stream.finish()
        return stream.message()

    def _finish_reason(self, i: int, reason: str | None) -> str | None:
        return reason if self.tool_streams is None else self.tool_streams[i].finish_reason(reason)

    def _deltas(self, i: int, text: str, finished: bool) -> list[dict]:
        """The choice's deltas for newly generated text: content as is, or through its tool-call stream."""
        if self.tool_streams is None:
            return [{"content": text}] if text else []
        stream = self.tool_streams[i]
        return stream.feed(text) + (stream.finish() if finished else [])

    async def events(self, streams):
        # content is null when the tool choice makes the reply a call (named, required), as OpenAI sends it
        first = None if self.plan is not None and self.plan.constrains else ""
        for i in range(self.req.n):
            yield self._chunk([{"index": i, "delta": {"role": "assistant", "content": first}, "logprobs": None,
                                "finish_reason": None}])
        done: set[int] = set()
        async for _, out in merged(self.state, streams, [self.prompt_tokens]):
            for c in out.outputs:
                if c.index in done:  # a finished choice comes again, empty, in later outputs of the request
                    continue
                self.token_ids[c.index] += c.token_ids
                logprobs = self._logprobs(c.token_ids, c.logprobs or [])
                deltas = self._deltas(c.index, c.text, c.finish_reason is not None)
                for delta in deltas:
                    # a tool call's deltas each in a chunk of their own; the tokens' logprobs ride on the first
                    yield self._chunk([{"index": c.index, "delta": delta, "logprobs": logprobs,
                                        "finish_reason": None}])
                    logprobs = None
                if not deltas and c.token_ids and self.req.logprobs:  # tokens without text yet (a split
                    # character, or text a tool-call parser holds back)
                    yield self._chunk([{"index": c.index, "delta": {}, "logprobs": logprobs, "finish_reason": None}])
                if c.finish_reason is not None:
                    done.add(c.index)
                    yield self._chunk([{"index": c.index, "delta": {}, "logprobs": None,
                                        "finish_reason": self._finish_reason(c.index, c.finish_reason)}])
        if self.req.stream_options and self.req.stream_options.include_usage:
            yield sse({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                       "model": self.model, "choices": [], "usage": self.usage()})
