"""The chat page at / (`--no-ui` leaves it out): three static files shipped with fw.server
(ui/index.html, ui/app.js, ui/style.css), no build step and nothing from outside, read on
the first request for each, so the page costs start-up nothing.

The files are open without the API key: they hold no secret (the page asks its user for the
key, keeps it in sessionStorage and sends it on its API calls, which need it as any client's do).
A strict Content-Security-Policy lets the page load only its own script and style and talk only
to this server; the script writes model output as text, never as HTML."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response

UI_DIR = Path(__file__).parent.parent / "ui"
FILES = {  # route -> (file under ui/, Content-Type)
    "/": ("index.html", "text/html; charset=utf-8"),
    "/ui/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/ui/style.css": ("style.css", "text/css; charset=utf-8"),
}
PATHS = frozenset(FILES)  # open without the key (fw.server.app)
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY",
           "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}

router = APIRouter(include_in_schema=False)


@lru_cache(maxsize=None)
def _read(name: str) -> bytes:
    return (UI_DIR / name).read_bytes()


def _serve(route: str) -> Response:
    name, media_type = FILES[route]
    return Response(_read(name), media_type=media_type, headers=HEADERS)


@router.get("/")
async def index() -> Response:
    return _serve("/")


@router.get("/ui/app.js")
async def script() -> Response:
    return _serve("/ui/app.js")


@router.get("/ui/style.css")
async def style() -> Response:
    return _serve("/ui/style.css")
