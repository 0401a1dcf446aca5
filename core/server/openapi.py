"""/openapi.json that documents the statuses the server sends.

FastAPI adds a 422 to every route with a body; this server never sends 422 (bad input is a 400,
as OpenAI's API answers), so the schema drops it and lists the real error statuses, each with
OpenAI's error body."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from fw.server.protocol import ErrorResponse

WHEN: dict[int, str] = {
    400: "Malformed JSON, a wrong type, an out-of-range value, or a prompt too long",
    401: "--api-key is set and the Authorization: Bearer header is missing or wrong",
    404: "The model name is not one this server serves",
    413: "The body is over --payload-limit bytes",
    429: "Every slot is busy (--max-concurrent-requests) or the queue is full (--max-queue-size)",
    500: "An engine fault; the engine keeps serving",
    503: "The server is shutting down",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` for a route: each status with its meaning and OpenAI's error body."""
    return {status: {"model": ErrorResponse, "description": WHEN[status]} for status in statuses}


def install(app: FastAPI) -> None:
    """Serve the schema without FastAPI's 422 (and its now unused validation-error models)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            models = schema.get("components", {}).get("schemas", {})
            for unused in ("HTTPValidationError", "ValidationError"):
                models.pop(unused, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
