"""Loading and unloading LoRA adapters while serving, as vLLM's routes: `POST /v1/load_lora_adapter`
`{"lora_name", "lora_path"}` and `POST /v1/unload_lora_adapter` `{"lora_name"}`. Both need the API key
when one is set (no route but the open ones goes without), and run on the engine thread between two
steps. An adapter still running requests is not unloaded (400)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from fw.errors import InvalidRequestError
from fw.server.openapi import error_responses
from fw.server.protocol import _Request
from fw.server.state import ServerState

router = APIRouter()


class LoadLoRARequest(_Request):
    lora_name: str
    lora_path: str


class UnloadLoRARequest(_Request):
    lora_name: str


def _engine(state: ServerState):
    """The engine whose adapters a request changes (on the engine's thread), or a 400 without --enable-lora."""
    if state.lora is None:
        raise InvalidRequestError("this server serves no LoRA adapters; start it with --enable-lora",
                                  param="lora_name")
    return state.engine.engine


@router.post("/v1/load_lora_adapter", responses=error_responses(400, 401))
async def load_lora_adapter(req: LoadLoRARequest, request: Request) -> dict:
    state: ServerState = request.app.state.fw
    engine = _engine(state)
    if req.lora_name in state.served_names:
        raise InvalidRequestError(f"{req.lora_name!r} is the base model's name; name the adapter otherwise",
                                  param="lora_name")
    await state.engine.on_engine_thread(lambda: engine.add_lora(req.lora_name, req.lora_path))
    return {"lora_name": req.lora_name, "status": "loaded"}


@router.post("/v1/unload_lora_adapter", responses=error_responses(400, 401, 404))
async def unload_lora_adapter(req: UnloadLoRARequest, request: Request) -> dict:
    state: ServerState = request.app.state.fw
    engine = _engine(state)
    await state.engine.on_engine_thread(lambda: engine.remove_lora(req.lora_name))
    return {"lora_name": req.lora_name, "status": "unloaded"}
