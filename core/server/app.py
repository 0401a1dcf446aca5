"""The FastAPI application: routes, OpenAI-style errors, auth, payload limit."""

from __future__ import annotations

import hmac
import json
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from fw.errors import FwError
from fw.server import body_errors, openapi
from fw.server.routes import chat, completions, embeddings, lora, misc, ui
from fw.server.logtext import quoted
from fw.server.protocol import error_body
from fw.server.state import ServerState
from fw.version import __version__

logger = logging.getLogger("fw.server")


def _error(state: ServerState | None, status: int, message: str, error_type: str,
           param: str | None = None) -> JSONResponse:
    if state is not None:
        state.metrics.error(status)
    return JSONResponse(error_body(message, error_type, status, param), status_code=status)


# Routes answered without the API key: probes and scrapers hold no key, and these tell nothing about
# requests (up or down, counts and latencies, the version, the schema). Everything else needs it.
OPEN_ROUTES = frozenset({"/health", "/metrics", "/version", "/openapi.json", "/docs", "/docs/oauth2-redirect",
                         "/redoc"})


def _validation_message(exc: RequestValidationError, request: Request) -> tuple[str, str | None]:
    """Pydantic's errors as one readable sentence, and the first offending field."""
    if request.method in ("POST", "PUT", "PATCH") and not body_errors.is_json(request.headers.get("content-type")):
        return body_errors.wrong_content_type(request.headers.get("content-type")), None
    parts, param = [], None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            return f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}", None
        if not loc and err.get("type") == "missing":
            return f"the request body is empty; {body_errors.SEND_JSON}", None
        if not loc and not isinstance(err.get("input"), dict):
            return body_errors.not_an_object(err.get("input")), None
        where = ".".join(loc) or "body"
        param = param or (loc[0] if loc else None)
        parts.append(f"{where}: {err.get('msg')}")
    return "invalid request: " + "; ".join(parts), param


def build_app(state: ServerState, on_shutdown=None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine.start()
        yield
        state.draining = True
        if on_shutdown is not None:
            await on_shutdown()

    app = FastAPI(title="fw", version=__version__, lifespan=lifespan)
    app.state.fw = state
    app.add_middleware(BodyLimit, limit=state.config.payload_limit)
    open_routes = OPEN_ROUTES | (ui.PATHS if state.config.ui else frozenset())  # the page's files

    @app.middleware("http")
    async def guard(request: Request, call_next):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > state.config.payload_limit:
            return _error(state, 413, f"the request body has {length} bytes, more than the "
                          f"{state.config.payload_limit} allowed (--payload-limit)", "invalid_request_error")
        if state.config.api_key is not None and request.url.path not in open_routes:
            given = request.headers.get("authorization", "")
            expected = f"Bearer {state.config.api_key}"
            if not hmac.compare_digest(given.encode(), expected.encode()):
                return _error(state, 401, "invalid or missing API key: send `Authorization: Bearer <key>`",
                              "authentication_error")
        if state.config.log_requests and request.method == "POST":
            logger.info("%s %s from %s", request.method, quoted(request.url.path),
                        request.client.host if request.client else "?")
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc, request)
        return _error(state, 400, message, "invalid_request_error", param)

    @app.exception_handler(FwError)
    async def on_fw_error(request: Request, exc: FwError):
        if exc.status_code >= 500:
            logger.error("request failed: %s", quoted(exc))
        return _error(state, exc.status_code, str(exc), exc.error_type, getattr(exc, "param", None))

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = str(exc.detail)
        if exc.status_code == 400 and "parsing the body" in message:  # the JSON parser raised: say why
            message = body_errors.unreadable(exc.__cause__)
        return _error(state, exc.status_code, message, kind)

    @app.exception_handler(Exception)
    async def on_crash(request: Request, exc: Exception):
        logger.exception("unhandled error on %s", quoted(request.url.path))
        return _error(state, 500, "internal server error; see the server log", "internal_error")

    app.include_router(completions.router)
    app.include_router(chat.router)
    app.include_router(misc.router)
    app.include_router(embeddings.router)
    app.include_router(lora.router)
    if state.config.ui:
        app.include_router(ui.router)
    _add_plugin_routes(app, state)
    openapi.install(app)
    return app


def _add_plugin_routes(app: FastAPI, state: ServerState) -> None:
    """Routes from plugins (`fw_add_server_routes`), each plugin on its own: one that fails is skipped."""
    for plugin, add_routes in state.plugins.hook_implementations("fw_add_server_routes"):
        try:
            add_routes(app=app, state=state)
        except Exception:
            logger.exception("plugin %s failed to add server routes; they are missing", plugin)


class BodyLimit:
    """--payload-limit for bodies sent without Content-Length (chunked), which `guard` cannot
    check up front: count the bytes as they arrive and refuse with 413 once over the limit,
    instead of reading (and then tokenizing) a body of any size."""

    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise StarletteHTTPException(413, f"the request body is larger than the {self.limit} bytes "
                                                      f"allowed (--payload-limit)")
            return message

        await self.app(scope, limited_receive, send)


class JsonLogFormatter(logging.Formatter):
    """One JSON object per line, for log shippers (--json-logs)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": self.formatTime(record), "level": record.levelname, "logger": record.name,
                 "message": record.getMessage()}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)
