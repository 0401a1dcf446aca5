"""The chat page at / (fw.server.routes.ui) on the FastAPI app in process over the tiny GQA model
with the DRY and XTC plugins: its files with their content types and security headers, nothing
from outside, no inline script and no HTML made from model output, open without the key while the
API it calls is not, --no-ui, the sampler route it builds its controls from, and the request log
that shows what the page sent. (A real browser drives it in tests/test_ui_browser.py.)"""

from __future__ import annotations

import asyncio
import logging
import re
import tomllib
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from conftest import make_llm
from fw.server.routes import ui as routes_ui
from fw.server.app import build_app
from fw.server.async_engine import AsyncEngine
from fw.server.config import ServerConfig
from fw.server.metrics import ServerMetrics
from fw.server.state import ServerState, describe_params
from fw.sampling.params import SamplingParams
from sampler_plugins import manager_with_sampler_plugins

KEY = "sk-ui-test-key"
ROOT = Path(__file__).resolve().parent.parent
FILES = {"/": "text/html", "/ui/app.js": "text/javascript", "/ui/style.css": "text/css"}


@pytest.fixture(scope="module")
def engine(gqa_dir):
    return make_llm(gqa_dir, plugins=manager_with_sampler_plugins()).engine


def app_for(engine, **config) -> tuple:
    async_engine = AsyncEngine(engine)
    state = ServerState(async_engine, ServerConfig(**config), ["tiny"],
                        ServerMetrics("tiny", "sdpa", lambda: async_engine.stats))
    return build_app(state), async_engine


def test_the_page_and_its_files(engine):
    app, _ = app_for(engine)
    http = TestClient(app)
    for path, media in FILES.items():
        r = http.get(path)
        assert r.status_code == 200, (path, r.text)
        assert r.headers["content-type"].startswith(media), (path, r.headers["content-type"])
        assert r.headers["x-content-type-options"] == "nosniff"
        csp = r.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "connect-src 'self'" in csp and "default-src 'none'" in csp
        assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
    page = http.get("/").text
    assert '<script src="/ui/app.js"' in page and 'href="/ui/style.css"' in page
    assert http.get("/ui/other.js").status_code == 404  # only the page's own files
    assert "/" not in app.openapi()["paths"]  # not an API route


def test_the_files_work_offline_and_never_render_model_output_as_html():
    texts = {name: (routes_ui.UI_DIR / name).read_text() for name in ("index.html", "app.js", "style.css")}
    for name, text in texts.items():
        assert not re.search(r"https?://", text), f"{name} names an outside address"
        assert "@import" not in text and "url(" not in text.replace("data:,", ""), name
    html = texts["index.html"]
    assert not re.search(r"<script(?![^>]*\bsrc=)[^>]*>", html), "inline script (the CSP would block it)"
    assert not re.search(r"\son[a-z]+\s*=", html) and " style=" not in html
    js = texts["app.js"]
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in js, sink
    assert "textContent = text" in js  # the streamed reply is written as text
    assert "sessionStorage" in js and "localStorage" not in js  # the key lives for the tab only


def test_the_ui_files_are_package_data():
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = setup["package-data"]["fw.server"]
    for file in routes_ui.UI_DIR.iterdir():
        assert any(Path("ui", file.name).match(p) for p in patterns), file.name


def test_no_ui_answers_404(engine):
    app, _ = app_for(engine, ui=False)
    http = TestClient(app)
    for path in FILES:
        assert http.get(path).status_code == 404
    app, _ = app_for(engine, ui=False, api_key=KEY)
    assert TestClient(app).get("/").status_code == 401  # an unknown path, like any other, without the key


def test_the_page_is_open_but_the_api_needs_the_key_and_the_page_holds_none(engine):
    app, _ = app_for(engine, api_key=KEY)
    http = TestClient(app)
    for path in FILES:
        r = http.get(path)
        assert r.status_code == 200 and KEY not in r.text, path
    assert http.get("/v1/models").status_code == 401
    assert http.get("/v1/fw/samplers").status_code == 401
    authed = {"Authorization": f"Bearer {KEY}"}
    assert http.get("/v1/models", headers=authed).status_code == 200


def test_sampler_route_lists_per_request_samplers_with_their_parameters(engine):
    app, _ = app_for(engine)
    data = TestClient(app).get("/v1/fw/samplers").json()["data"]
    by_name = {s["name"]: s for s in data}
    xtc = by_name["xtc"]
    assert xtc["per_request"] is True and xtc["role"] == "stage" and xtc["distribution"] == "fw-sampler-xtc"
    assert xtc["parameters"]["properties"]["threshold"]["default"] == 0.1
    assert by_name["dry"]["parameters"]["properties"]["allowed_length"]["type"] == "integer"
    assert any(not s["per_request"] for s in data)  # the built-in stages too, with their order
    assert [s["order"] for s in data] == sorted(s["order"] for s in data)


def test_logged_requests_show_the_sampling_fields_the_page_sent(engine, caplog):
    app, async_engine = app_for(engine, log_requests=True)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0.3, "seed": 7,
            "top_p": 0.9, "samplers": [{"name": "xtc", "threshold": 0.2, "probability": 0.5}], "stream": True}
    with caplog.at_level(logging.INFO, logger="fw.server"), TestClient(app) as http:
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and "data: [DONE]" in r.text
    asyncio.run(async_engine.drain(5.0))
    lines = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith("request chatcmpl")]
    assert len(lines) == 1, caplog.text
    line = lines[0]
    for part in ("temperature=0.3", "top_p=0.9", "seed=7", "max_tokens=3",
                 'samplers=[{"name": "xtc", "threshold": 0.2, "probability": 0.5}]'):
        assert part in line, (part, line)


def test_describe_params_escapes_request_text():
    params = SamplingParams(stop=["\n\x1b[2J"], temperature=0.0, logit_bias={1: 2.0},
                            samplers=[{"name": "dry", "sequence_breakers": ["\n"]}],
                            structured_outputs={"json": {"type": "object"}})
    text = describe_params(params)
    assert "\n" not in text and "\x1b" not in text
    assert "temperature=0.0" in text and "structured_outputs=json" in text and "logit_bias=1 entries" in text
    assert describe_params(SamplingParams()) == "defaults"
