"""The start of every engine's `add_request`: a free request id and the prompt's token ids."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from fw.errors import InvalidRequestError


def request_id_and_ids(requests: dict, new_id: Callable[[], str], tokenize: Callable[[str], list[int]],
                       request_id: str | None, prompt: str | None, prompt_token_ids: Sequence[int] | None, *,
                       missing: str = "give a prompt or prompt_token_ids", param: str = "prompt",
                       ) -> tuple[str, list[int]]:
    """`request_id` (or a new one) if no live request holds it, and the token ids given or of `prompt`."""
    request_id = request_id or new_id()
    if request_id in requests:
        raise InvalidRequestError(f"request id {request_id!r} is already in use")
    if prompt_token_ids is None:
        if prompt is None:
            raise InvalidRequestError(missing, param=param)
        prompt_token_ids = tokenize(prompt)
    return request_id, [int(t) for t in prompt_token_ids]
