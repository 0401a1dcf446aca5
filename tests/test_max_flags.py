"""MAX's flags that fw lacked (issue 19 item 6), honoured where they act, over the tiny GQA model:
--enable-structured-output / --no-enable-structured-output (constraints refused when off), --enable-echo /
--no-enable-echo (echo refused when off), --chat-template (used by the chat route, /tokenize, LLM.chat and
transformers' fallback, never written into the tokenizer's snapshot) and --quantization-encoding's GGUF
weight types (checked against the file). How each flag reaches its config field: tests/test_config.py."""

from __future__ import annotations

import asyncio

import pytest
from fastapi.testclient import TestClient

from conftest import make_llm
from fw import SamplingParams
from fw.errors import ConfigError, InvalidRequestError
from fw.grammar.constraint import StructuredOutputsParams
from fw.model.hf import load_tokenizer
from fw.server.app import build_app
from fw.server.async_engine import AsyncEngine
from fw.server.config import ServerConfig
from fw.server.metrics import ServerMetrics
from fw.server.state import ServerState
from fw.testing.models import CHAT_TEMPLATE
from server_fixtures import assert_error_body

HI = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}
# A template nothing else renders: its text shows which template a prompt went through.
TEMPLATE = ("{% for m in messages %}### {{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}### assistant:{% endif %}")


def serve(llm, **server_options):
    """A TestClient over `llm`'s engine (closed by the caller's `with`)."""
    engine = AsyncEngine(llm.engine)
    state = ServerState(engine, ServerConfig(**server_options), ["tiny"],
                        ServerMetrics("tiny", "sdpa", lambda: engine.stats))
    return TestClient(build_app(state)), engine


@pytest.fixture(scope="module")
def plain(gqa_dir):
    """The server with structured output and echo switched off, and the template file's engine."""
    llm = make_llm(gqa_dir, enable_structured_output=False)
    client, engine = serve(llm, enable_echo=False)
    with client:
        yield llm, client
    asyncio.run(engine.drain(5.0))


def test_structured_output_off_refuses_constraints_with_a_400(plain):
    llm, http = plain
    for path, body in [("/v1/chat/completions", {"messages": HI, "max_tokens": 2, "response_format": SCHEMA}),
                       ("/v1/chat/completions", {"messages": HI, "max_tokens": 2,
                                                  "response_format": {"type": "json_object"}}),
                       ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "guided_regex": "a+"})]:
        r = http.post(path, json={"model": "tiny", **body})
        assert "--no-enable-structured-output" in assert_error_body(r, 400)["message"]
    assert http.post("/v1/chat/completions", json={"model": "tiny", "messages": HI, "max_tokens": 2}).status_code == 200
    with pytest.raises(InvalidRequestError, match="--enable-structured-output"):  # the library too
        llm.generate("hi", SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(regex="a+")))


def test_echo_off_refuses_echo_with_a_400(plain):
    _, http = plain
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "the river", "max_tokens": 1, "echo": True})
    err = assert_error_body(r, 400)
    assert "--no-enable-echo" in err["message"] and err["param"] == "echo"
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "the river", "max_tokens": 1})
    assert r.status_code == 200


def test_echo_and_structured_output_are_on_by_default(gqa_dir):
    # an engine of its own: the server's stepping thread must not outlive the test on the session's shared `llm`
    llm = make_llm(gqa_dir)
    client, engine = serve(llm)
    with client as http:
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": "the river", "max_tokens": 1,
                                                "echo": True, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"].startswith("the river")
    asyncio.run(engine.drain(5.0))
    assert llm.engine.grammar.enabled


def test_a_chat_template_file_replaces_the_models_everywhere_a_chat_is_rendered(gqa_dir, tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    llm = make_llm(gqa_dir, chat_template=str(path))
    tok = llm.tokenizer
    expected = "### user: hi\n### assistant:"
    assert tok.chat_template == TEMPLATE
    assert llm.apply_chat_template(HI)["prompt"] == expected  # LLM.chat renders through this
    ids = tok(expected, add_special_tokens=False).input_ids
    # transformers' own renderer (what FastTokenizer hands unusual calls to) gets the same template
    assert tok.apply_chat_template(HI, tokenize=False, continue_final_message=True) == "### user: hi"
    client, engine = serve(llm)
    with client as http:
        assert http.post("/tokenize", json={"model": "tiny", "messages": HI}).json()["tokens"] == ids
        r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": HI, "max_tokens": 1})
        assert r.json()["usage"]["prompt_tokens"] == len(ids)
    asyncio.run(engine.drain(5.0))
    # the tokenizer's snapshot still holds the model's own template: an engine without the flag gets it
    assert load_tokenizer(gqa_dir, False).chat_template == CHAT_TEMPLATE


def test_an_inline_chat_template_reaches_the_engine(gqa_dir):
    llm = make_llm(gqa_dir, chat_template=TEMPLATE.replace("\n", "\\n"))  # as a shell passes it
    assert llm.apply_chat_template(HI, add_generation_prompt=False)["prompt"] == "### user: hi\n"


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory, tokenizer):
    import gguf
    import gguf_models

    root = tmp_path_factory.mktemp("encoding")
    tokenizer.save_pretrained(root / "tokenizer")  # the tiny GGUF file carries no vocabulary
    gguf_models.write_tiny_llama_gguf(root / "q4_0.gguf", gguf.GGMLQuantizationType.Q4_0, tokenizer)
    return root / "q4_0.gguf"


def test_a_gguf_encoding_is_checked_against_the_file(gguf_file, gqa_dir):
    tok = str(gguf_file.parent / "tokenizer")
    llm = make_llm(gguf_file, tokenizer=tok, quantization_encoding="q4_0", num_kv_blocks=32)
    assert llm.generate("the", SamplingParams(max_tokens=1))[0].outputs[0].token_ids
    with pytest.raises(ConfigError, match=r"--quantization-encoding q4_k: the linear weights of q4_0.gguf are Q4_0, "
                                          r"not Q4_K"):
        make_llm(gguf_file, tokenizer=tok, quantization_encoding="q4_k", num_kv_blocks=32)
    with pytest.raises(ConfigError, match=r"--quantization-encoding q6_k names a GGUF weight type, but .* is not a "
                                          r"\.gguf file"):
        make_llm(gqa_dir, quantization_encoding="q6_k")


def test_a_draft_model_takes_neither_the_targets_encoding_nor_its_template():
    from fw.config import EngineConfig
    from fw.speculative.draft_runner import draft_engine_config

    target = EngineConfig(quantization_encoding="gptq", chat_template=TEMPLATE)
    draft = draft_engine_config(target, "draft/model", {})
    assert (draft.quantization, draft.quantization_encoding, draft.chat_template) == (None, None, None)
    assert draft_engine_config(EngineConfig(quantization_encoding="float32"), "d", {}).dtype == "float32"
