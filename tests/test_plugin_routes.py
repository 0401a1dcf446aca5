"""Plugins add server routes through `fw_add_server_routes`; a failing one is skipped."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

import plugin_fixtures as pf
from fw.engine.engine import LLMEngine
from fw.config import EngineConfig
from fw.server.app import build_app
from fw.server.async_engine import AsyncEngine
from fw.server.config import ServerConfig
from fw.server.metrics import ServerMetrics
from fw.server.state import ServerState

pytestmark = pytest.mark.usefixtures("isolated_plugins")

ROUTES = """
@hookimpl
def fw_add_server_routes(app, state):
    @app.get("/v1/example/served")
    def served():
        return {"names": state.served_names, "vocab": state.engine.engine.vocab_size}
"""
BROKEN = """
@hookimpl
def fw_add_server_routes(app, state):
    raise RuntimeError("cannot add my routes")
"""


def test_plugin_routes_are_served_and_a_broken_plugin_is_skipped(root, gqa_dir) -> None:
    for name, body in (("routes_ok", ROUTES), ("routes_broken", BROKEN)):
        module = pf.unique(f"fwtest_{name}")
        pf.make_distribution(root, f"fw-{name.replace('_', '-')}", {module: pf.plugin_source(body)}, {name: module})
    plugins = pf.builtin_manager(root)
    engine = LLMEngine(EngineConfig(model=str(gqa_dir), num_kv_blocks=32), plugins)
    async_engine = AsyncEngine(engine)
    state = ServerState(async_engine, ServerConfig(api_key="k"), ["tiny"],
                        ServerMetrics("tiny", "sdpa", lambda: async_engine.stats))
    with TestClient(build_app(state)) as client:
        assert client.get("/v1/example/served").status_code == 401  # /v1 routes share the server's auth
        r = client.get("/v1/example/served", headers={"Authorization": "Bearer k"})
        assert r.json() == {"names": ["tiny"], "vocab": engine.vocab_size}
        assert client.get("/health").status_code == 200
