"""Chat messages to a prompt through the tokenizer's own chat template."""

from __future__ import annotations

from typing import Any

from fw.errors import InvalidRequestError


def chat_text(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
              chat_template_kwargs: dict | None = None, tools: list[dict] | None = None) -> str:
    """The rendered prompt text, not yet tokenized: the server bounds its size first.
    `tools` (JSON-schema function descriptions) and the messages' `tool_calls` / `tool_call_id`
    go to the template as given: it decides how a model sees them."""
    if not messages:
        raise InvalidRequestError("messages must not be empty", param="messages")
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("this model's tokenizer has no chat template; send a plain prompt instead",
                                  param="messages")
    try:
        kwargs = dict(chat_template_kwargs or {})
        if tools is not None:
            kwargs["tools"] = tools
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **kwargs)
    except Exception as exc:  # template errors (role order, missing fields) are the caller's to fix
        raise InvalidRequestError(f"the chat template rejected these messages: {exc}", param="messages") from None


def chat_token_ids(tokenizer, text: str) -> list[int]:
    """A rendered chat prompt's ids; the template already wrote any special tokens."""
    return tokenizer(text, add_special_tokens=False).input_ids


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                chat_template_kwargs: dict | None = None, tools: list[dict] | None = None) -> dict[str, Any]:
    """Returns {"prompt": text, "prompt_token_ids": ids}."""
    text = chat_text(tokenizer, messages, add_generation_prompt, chat_template_kwargs, tools)
    return {"prompt": text, "prompt_token_ids": chat_token_ids(tokenizer, text)}
