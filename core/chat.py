"""Chat messages to a prompt through the tokenizer's own chat template."""

from __future__ import annotations

from typing import Any

from fw.errors import InvalidRequestError


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                chat_template_kwargs: dict | None = None, tools: list[dict] | None = None) -> dict[str, Any]:
    """Returns {"prompt": text, "prompt_token_ids": ids}; the template adds any special tokens.
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
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **kwargs)
    except Exception as exc:  # template errors (role order, missing fields) are the caller's to fix
        raise InvalidRequestError(f"the chat template rejected these messages: {exc}", param="messages") from None
    ids = tokenizer(text, add_special_tokens=False).input_ids
    return {"prompt": text, "prompt_token_ids": ids}
