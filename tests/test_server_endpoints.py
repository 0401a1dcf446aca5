"""`fw serve`'s other routes and its names, on a tiny model served as two aliases with the API key
taken from FW_API_KEY: /health, /version, /tokenize and /detokenize, the plugin inventory,
/openapi.json, /metrics (names and labels), /v1/models, and the ready-to-paste curl line."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess

import httpx
import pytest
from server_fixtures import assert_error_body, metric, running_server

KEY = "sk-from-env"
NAMES = ["tiny-a", "tiny-b"]


@pytest.fixture(scope="module")
def server(gqa_dir, tmp_path_factory):
    args = ["--model", str(gqa_dir), "--num-kv-blocks", "64", "--dtype", "float32", "--attention-backend", "sdpa"]
    for name in NAMES:
        args += ["--served-model-name", name]
    with running_server(args, tmp_path_factory.mktemp("tiny_endpoints"), env={"FW_API_KEY": KEY}) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with server.client(api_key=KEY, timeout=30) as c:
        yield c


def test_health_and_version_need_no_key(server):
    assert httpx.get(server.url + "/health").status_code == 200
    r = httpx.get(server.url + "/version")
    assert r.status_code == 200
    info = r.json()
    assert info["version"] == importlib.metadata.version("fw") and info["plugin_api"]


def test_api_key_from_the_environment(server):
    assert_error_body(httpx.get(server.url + "/v1/models"), 401)
    assert_error_body(httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer nope"}), 401)
    r = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200


def test_every_alias_is_listed_and_served(http):
    models = http.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == NAMES
    assert all(m["max_model_len"] == 512 for m in models["data"])
    for name in NAMES:
        r = http.post("/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == name
        r = http.post("/v1/chat/completions", json={"model": name, "max_tokens": 2,
                                                    "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["model"] == name
    # no model: the first name
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).json()["model"] == NAMES[0]
    # the directory name is not one of the names any more
    err = assert_error_body(http.post("/v1/completions", json={"model": "gqa", "prompt": "hi"}), 404)
    assert all(name in err["message"] for name in NAMES)


def test_tokenize_detokenize_round_trip(http):
    text = "The engine schedules every request in pages."
    r = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
    assert r.status_code == 200
    body = r.json()
    assert body["count"] == len(body["tokens"]) > 3 and body["max_model_len"] == 512
    assert http.post("/detokenize", json={"tokens": body["tokens"]}).json()["prompt"] == text
    with_bos = http.post("/tokenize", json={"prompt": text}).json()["tokens"]
    assert with_bos[1:] == body["tokens"] and len(with_bos) == body["count"] + 1
    # the prompt a completion sees has the same tokens
    usage = http.post("/v1/completions", json={"prompt": text, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == len(with_bos)


def test_tokenize_messages_matches_chat_prompt(http):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a river."}]
    r = http.post("/tokenize", json={"messages": messages})
    assert r.status_code == 200
    tokens = r.json()["tokens"]
    usage = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == len(tokens)
    text = http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert "<|system|>Be brief." in text and text.endswith("<|assistant|>")  # tiny_models.CHAT_TEMPLATE


def test_plugins_lists_the_built_ins(http):
    r = http.get("/v1/fw/plugins")
    assert r.status_code == 200
    plugins = {p["name"]: p for p in r.json()["plugins"]}
    built_in = {ep.name for ep in importlib.metadata.distribution("fw").entry_points if ep.group == "fw"}
    assert built_in >= {"llama", "sdpa", "samplers"}
    for name in built_in:
        assert plugins[name]["status"] == "loaded" and plugins[name]["distribution"] == "fw", plugins.get(name)
    assert "sdpa" in plugins["sdpa"]["provides"]["attention_backend"]
    assert "llama" in plugins["llama"]["provides"]["architecture"]


def test_openapi_schema_lists_the_v1_paths(server):
    r = httpx.get(server.url + "/openapi.json")
    assert r.status_code == 200
    schema = json.loads(r.text)
    assert schema["openapi"].startswith("3.")
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models"):
        assert path in schema["paths"], sorted(schema["paths"])
    assert "post" in schema["paths"]["/v1/chat/completions"]


METRICS = ["fw_request_success", "fw_prompt_tokens", "fw_generation_tokens", "fw_time_to_first_token_seconds",
           "fw_inter_token_latency_seconds", "fw_e2e_request_latency_seconds", "fw_num_requests_running",
           "fw_num_requests_waiting", "fw_kv_cache_usage_ratio", "fw_prefix_cache_hit_rate", "fw_num_preemptions"]


def test_metrics_have_every_name_with_model_and_backend_labels(server, http):
    before = server.metrics_text()
    r = http.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200
    resp = httpx.get(server.url + "/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(resp.text)}
    for name in METRICS:
        assert name in families, f"{name} missing from /metrics: {sorted(families)}"
        samples = families[name].samples
        assert samples, name
        for sample in samples:
            assert sample.labels.get("model_name") == NAMES[0], (name, sample)
            assert sample.labels.get("attention_backend") == "sdpa", (name, sample)

    def grew(name: str, **labels: str) -> float:
        return metric(resp.text, name, **labels) - metric(before, name, **labels)

    assert grew("fw_request_success_total", finished_reason="length") == 1
    assert grew("fw_generation_tokens_total") == 4
    assert grew("fw_prompt_tokens_total") == r.json()["usage"]["prompt_tokens"]
    assert grew("fw_time_to_first_token_seconds_count") == 1
    assert grew("fw_inter_token_latency_seconds_count") == 3
    assert grew("fw_e2e_request_latency_seconds_count") == 1


def test_curl_line_with_the_key_works(server):
    """The line reads the key from $FW_API_KEY: the key itself is in neither stdout nor the log."""
    assert KEY not in server.stdout() and KEY not in server.log(), server.describe()
    line = next(ln for ln in server.stdout().splitlines() if ln.startswith("curl "))
    assert '-H "Authorization: Bearer $FW_API_KEY"' in line and f'"model": "{NAMES[0]}"' in line
    assert '"temperature": 0' in line
    done = subprocess.run(line, shell=True, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "FW_API_KEY": KEY})
    assert done.returncode == 0, done.stderr
    body = json.loads(done.stdout)
    assert body["object"] == "chat.completion" and body["model"] == NAMES[0], body
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
