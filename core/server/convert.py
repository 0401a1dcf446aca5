"""OpenAI request fields -> `SamplingParams`, and engine logprobs -> OpenAI's shapes."""

from __future__ import annotations

from fw.engine.outputs import Logprob
from fw.errors import InvalidRequestError
from fw.grammar.constraint import StructuredOutputsParams
from fw.sampling.params import SamplingParams
from fw.server.protocol import SamplingFields


def sampling_params(req: SamplingFields, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    bias = None
    if req.logit_bias:
        try:
            bias = {int(token): float(value) for token, value in req.logit_bias.items()}
        except ValueError:
            raise InvalidRequestError("logit_bias keys must be token ids (integers as strings)",
                                      param="logit_bias") from None
    return SamplingParams(
        n=req.n,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        min_p=req.min_p or 0.0,
        repetition_penalty=req.repetition_penalty or 1.0,
        frequency_penalty=req.frequency_penalty,
        presence_penalty=req.presence_penalty,
        seed=req.seed,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        include_stop_str_in_output=req.include_stop_str_in_output,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        logit_bias=bias,
        skip_special_tokens=req.skip_special_tokens,
        structured_outputs=structured_outputs(req),
        samplers=req.samplers,
        allowed_token_ids=req.allowed_token_ids,
        speculative=req.speculative,
        speculative_config=req.speculative_config,
    )


def structured_outputs(req: SamplingFields) -> StructuredOutputsParams | None:
    """The request's one output constraint, from whichever field carries it: `response_format`
    (OpenAI), `guided_json|regex|choice|grammar` (vLLM's extra_body) or `structured_outputs`
    (vLLM's newer name). `guided_decoding_backend` picks the grammar backend for the request."""
    found: list[tuple[str, dict]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif fmt.type == "json_schema":
            spec = fmt.json_schema or {}
            schema = spec.get("schema", spec.get("json_schema"))
            if schema is None:
                raise InvalidRequestError(
                    'response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}',
                    param="response_format")
            found.append(("response_format", {"json": schema}))
        else:
            raise InvalidRequestError(
                f"response_format type {fmt.type!r} is not supported; use text, json_object or json_schema",
                param="response_format")
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        value = getattr(req, name)
        if value is not None:
            found.append((name, {key: value}))
    if req.structured_outputs is not None:
        found.append(("structured_outputs", dict(req.structured_outputs)))
    if not found:
        if req.guided_decoding_backend:
            raise InvalidRequestError("guided_decoding_backend names a grammar backend but the request has no "
                                      "constraint (response_format, guided_* or structured_outputs)",
                                      param="guided_decoding_backend")
        return None
    if len(found) > 1:
        raise InvalidRequestError(
            f"give one output constraint; this request has {', '.join(n for n, _ in found)}", param=found[1][0])
    source, fields = found[0]
    if req.guided_decoding_backend:
        fields.setdefault("backend", req.guided_decoding_backend)
    try:
        return StructuredOutputsParams(**fields)
    except TypeError as exc:
        raise InvalidRequestError(f"{source}: {exc}", param=source) from None


def _text(lp: Logprob, token_id: int, tokenizer) -> str:
    return lp.decoded_token if lp.decoded_token is not None else tokenizer.decode([token_id])


class CompletionLogprobs:
    """Accumulates the legacy completions `logprobs` object: tokens, token_logprobs,
    top_logprobs and text_offset (character offsets into the returned text)."""

    def __init__(self, tokenizer, offset: int = 0):
        self.tokenizer = tokenizer
        self.offset = offset
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def add(self, token_id: int, entry: dict[int, Logprob] | None, top_n: int) -> None:
        text = _text(entry[token_id], token_id, self.tokenizer) if entry else self.tokenizer.decode([token_id])
        self.tokens.append(text)
        self.token_logprobs.append(entry[token_id].logprob if entry else None)
        if entry is None:
            self.top_logprobs.append(None)
        else:
            ranked = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[: max(top_n, 1)]
            self.top_logprobs.append({_text(lp, t, self.tokenizer): lp.logprob for t, lp in ranked})
        self.text_offset.append(self.offset)
        self.offset += len(text)

    def as_dict(self) -> dict:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs,
                "top_logprobs": self.top_logprobs, "text_offset": self.text_offset}

    def take(self) -> dict:
        """The entries added since the last take (streaming)."""
        out = self.as_dict()
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return out


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], top_n: int, tokenizer) -> dict:
    """The chat `logprobs` object: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    content = []
    for token_id, entry in zip(token_ids, entries):
        chosen = entry[token_id]
        text = _text(chosen, token_id, tokenizer)
        ranked = sorted(((t, lp) for t, lp in entry.items()), key=lambda kv: -kv[1].logprob)[:top_n]
        content.append({
            "token": text, "logprob": chosen.logprob, "bytes": list(text.encode("utf-8")),
            "top_logprobs": [{"token": (s := _text(lp, t, tokenizer)), "logprob": lp.logprob,
                              "bytes": list(s.encode("utf-8"))} for t, lp in ranked],
        })
    return {"content": content}
