"""Everything but generation: models, health, version, tokenize/detokenize,
the plugin inventory, the sampler plugins' parameters and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from fw.chat import render_chat
from fw.errors import InvalidRequestError
from fw.server.openapi import error_responses
from fw.server.protocol import DetokenizeRequest, TokenizeRequest, error_body
from fw.server.routes.chat import message_dicts
from fw.server.state import ServerState
from fw.version import PLUGIN_API_VERSION, __version__

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.fw


@router.get("/v1/models", responses=error_responses(401))
async def list_models(request: Request) -> dict:
    state = _state(request)
    base = state.served_names[0]
    models = [{"id": name, "object": "model", "created": int(state.started), "owned_by": "fw",
               "root": base, "max_model_len": state.max_length} for name in state.served_names]
    lora = state.lora  # loaded LoRA adapters, each under its parent (as vLLM)
    for name, path in (list(lora.registered.items()) if lora is not None else ()):
        models.append({"id": name, "object": "model", "created": int(state.started), "owned_by": "fw",
                       "root": str(path), "parent": base, "max_model_len": state.max_length})
    return {"object": "list", "data": models}


@router.get("/health", responses=error_responses(503))
async def health(request: Request) -> Response:
    state = _state(request)
    if state.engine.alive and not state.draining:
        degraded = state.degraded  # some data-parallel replicas are lost
        return JSONResponse({"status": "degraded", "detail": degraded}) if degraded else Response(status_code=200)
    why = f"the engine is dead: {state.engine.dead}" if state.engine.dead else "the engine is not serving"
    return JSONResponse(error_body(why, "service_unavailable", 503), status_code=503)


@router.get("/version")
async def version() -> dict:
    return {"version": __version__, "plugin_api": PLUGIN_API_VERSION}


@router.post("/tokenize", responses=error_responses(400, 401, 404, 413, 429, 503))
async def tokenize(req: TokenizeRequest, request: Request) -> dict:
    """Counts every prompt as given (no byte bound: the count is what a client asks for); the work
    runs off the event loop and holds an admission slot, as a generation request's would."""
    state = _state(request)
    state.model_name(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise InvalidRequestError("give exactly one of prompt or messages", param="prompt")
    messages = message_dicts(req.messages) if req.messages is not None else None
    with state.admission() as permit:
        if messages is not None:
            tokens = await state.engine.in_tokenizer_thread(
                lambda: render_chat(state.tokenizer, messages)["prompt_token_ids"])
        else:
            tokens = await state.engine.tokenize(req.prompt, req.add_special_tokens)
    permit.release()
    return {"tokens": tokens, "count": len(tokens), "max_model_len": state.max_length}


@router.post("/detokenize", responses=error_responses(400, 401, 404, 413, 429, 503))
async def detokenize(req: DetokenizeRequest, request: Request) -> dict:
    state = _state(request)
    state.model_name(req.model)
    vocab = state.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param="tokens")
    with state.admission() as permit:
        text = await state.engine.in_tokenizer_thread(lambda: state.tokenizer.decode(req.tokens))
    permit.release()
    return {"prompt": text}


@router.get("/v1/fw/plugins", responses=error_responses(401))
async def plugins(request: Request) -> dict:
    return {"plugins": _state(request).plugins.inventory()}


@router.get("/v1/fw/samplers", responses=error_responses(401))
async def samplers(request: Request) -> dict:
    """The sampler plugins: each with its role and order, and for the per-request ones (what a request's
    `samplers` may name) the JSON schema of their parameters. The chat page builds its controls from it."""
    registry = _state(request).plugins.registry("sampler")
    return {"object": "list", "data": [
        {"name": r.spec.name, "description": r.spec.description, "plugin": r.plugin, "distribution": r.distribution,
         "per_request": r.spec.per_request, **r.spec.summary()}
        for r in sorted(registry.registrations(), key=lambda r: (r.spec.order, r.spec.name))
    ]}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(_state(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)
