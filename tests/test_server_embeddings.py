"""POST /v1/embeddings (docs/embeddings.md, docs/server.md) in process: every input form, both
encodings, usage, the openai SDK's `embeddings.create` unchanged, and the 400s of a server whose
model serves the other task."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from fw import LLM
from fw.engine.factory import create_engine
from fw.config import EngineConfig
from fw.server.app import build_app
from fw.server.async_engine import AsyncEngine
from fw.server.config import ServerConfig
from fw.server.metrics import ServerMetrics
from fw.server.state import ServerState
from tiny_encoders import build_bert

SENTENCES = ["the quick brown fox", "a river", "one two three four five six seven", "hello"]


def serve(model: str, **options) -> TestClient:
    engine = create_engine(EngineConfig(model=model, dtype="float32", num_kv_blocks=64, **options))
    async_engine = AsyncEngine(engine)
    state = ServerState(async_engine, ServerConfig(), ["m"], ServerMetrics("m", "x", lambda: async_engine.stats))
    return TestClient(build_app(state))


def error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()["error"]
    assert body["code"] == status
    return body


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    return build_bert(tmp_path_factory.mktemp("bert") / "m")


@pytest.fixture(scope="module")
def expected(bert_dir) -> torch.Tensor:
    outs = LLM(str(bert_dir), dtype="float32").embed(SENTENCES)
    return torch.tensor([o.outputs.embedding for o in outs])


@pytest.fixture(scope="module")
def client(bert_dir):
    with serve(str(bert_dir)) as c:
        yield c


def data(response) -> torch.Tensor:
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "list" and body["model"] == "m"
    assert [d["index"] for d in body["data"]] == list(range(len(body["data"])))
    return torch.tensor([d["embedding"] for d in body["data"]])


def test_every_input_form(client, bert_dir, expected):
    tokenizer = LLM(str(bert_dir), dtype="float32").tokenizer
    ids = [tokenizer(s).input_ids for s in SENTENCES]
    torch.testing.assert_close(data(client.post("/v1/embeddings", json={"input": SENTENCES})), expected)
    torch.testing.assert_close(data(client.post("/v1/embeddings", json={"input": SENTENCES[1]})), expected[1:2])
    torch.testing.assert_close(data(client.post("/v1/embeddings", json={"input": ids[2]})), expected[2:3])
    torch.testing.assert_close(data(client.post("/v1/embeddings", json={"input": ids, "model": "m"})), expected)


def test_base64_and_usage(client, bert_dir, expected):
    r = client.post("/v1/embeddings", json={"input": SENTENCES, "encoding_format": "base64"})
    body = r.json()
    got = torch.tensor(np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
                                 for d in body["data"]]))
    torch.testing.assert_close(got, expected)
    tokens = sum(len(ids) for ids in LLM(str(bert_dir), dtype="float32").tokenizer(SENTENCES).input_ids)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_openai_sdk_embeddings_create(client, expected):
    """The SDK unchanged: it asks for base64 by default and decodes it itself."""
    from openai import OpenAI

    sdk = OpenAI(base_url=f"{client.base_url}/v1", api_key="none", http_client=client)
    result = sdk.embeddings.create(model="m", input=SENTENCES)
    torch.testing.assert_close(torch.tensor([d.embedding for d in result.data]), expected)
    floats = sdk.embeddings.create(model="m", input="a river", encoding_format="float")
    torch.testing.assert_close(torch.tensor(floats.data[0].embedding), expected[1])
    assert result.usage.prompt_tokens == result.usage.total_tokens > 0


def test_bad_requests(client):
    body = error(client.post("/v1/embeddings", json={"input": "a", "dimensions": 8}), 400)
    assert body["param"] == "dimensions" and "not Matryoshka" in body["message"]
    assert error(client.post("/v1/embeddings", json={"input": "a", "encoding_format": "int8"}),
                 400)["param"] == "encoding_format"
    for empty in ("", [], [[]], ["a", ""]):
        assert error(client.post("/v1/embeddings", json={"input": empty}), 400)["param"] == "input"
    assert "at most 2048" in error(client.post("/v1/embeddings", json={"input": ["a"] * 2049}), 400)["message"]
    assert "more than the 64" in error(client.post("/v1/embeddings", json={"input": "river " * 80}), 400)["message"]
    assert error(client.post("/v1/embeddings", json={"input": [10 ** 6]}), 400)["param"] == "input"
    error(client.post("/v1/embeddings", json={"input": "a", "model": "other"}), 404)
    error(client.post("/v1/embeddings", json={}), 400)


def test_generation_routes_refuse_an_encoder(client):
    chat = error(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}), 400)
    assert "served for embeddings" in chat["message"] and chat["param"] == "model"
    completion = error(client.post("/v1/completions", json={"prompt": "hi"}), 400)
    assert "/v1/completions" in completion["message"]
    assert client.get("/health").status_code == 200


def test_a_generation_server_refuses_embeddings(gqa_dir):
    with serve(str(gqa_dir)) as c:
        body = error(c.post("/v1/embeddings", json={"input": "Once upon a time"}), 400)
        assert "start the server with --task embed" in body["message"]


def test_a_decoder_served_with_task_embed(gqa_dir):
    expected = LLM(str(gqa_dir), dtype="float32", num_kv_blocks=64, task="embed", pooling="mean").embed(
        ["Once upon a time", "The sky is"])
    with serve(str(gqa_dir), task="embed", pooling="mean") as c:
        got = data(c.post("/v1/embeddings", json={"input": ["Once upon a time", "The sky is"]}))
        torch.testing.assert_close(got, torch.tensor([o.outputs.embedding for o in expected]))
        body = error(c.post("/v1/completions", json={"prompt": "hi"}), 400)
        assert "start the server without --task embed" in body["message"]
