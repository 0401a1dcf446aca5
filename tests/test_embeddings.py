"""Embeddings (docs/embeddings.md): the BERT encoder plugin and the encoder engine against
sentence-transformers and transformers on tiny random checkpoints, decoder models pooled through the
scheduler against transformers' hidden states, Matryoshka `dimensions`, and the errors a caller can
cause. The real all-MiniLM-L6-v2 is in tests/test_embeddings_minilm.py; the HTTP route in
tests/test_server_embeddings.py."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from conftest import make_llm
from fw import LLM
from fw.errors import ConfigError, InvalidRequestError, ModelLoadError, PromptTooLongError
from fw.pooling import PoolingParams
from tiny_encoders import build_bert

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a river",
    "one two three four five six seven eight nine ten hundred thousand first second last next every",
    "hello",
    "Paris, morning light; quiet garden!",
    "model token engine batch cache page block prefix sampler stream request output prompt logits attention",
]


def st_model(path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path), device="cpu")


def embed(llm: LLM, prompts, **params) -> torch.Tensor:
    outs = llm.embed(prompts, PoolingParams(**params) if params else None)
    return torch.tensor([o.outputs.embedding for o in outs])


def assert_close(got: torch.Tensor, ref: torch.Tensor, min_cos: float = 0.9999, atol: float = 1e-4) -> None:
    assert got.shape == ref.shape
    cos = F.cosine_similarity(got, ref.to(got.dtype), dim=-1)
    assert cos.min() >= min_cos, cos
    torch.testing.assert_close(got, ref.to(got.dtype), atol=atol, rtol=1e-3)


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    return build_bert(tmp_path_factory.mktemp("bert") / "mean")


# -- the encoder against its oracles --------------------------------------------------------------


@pytest.mark.parametrize("pooling", ["mean", "cls", "max", "mean_sqrt_len", "lasttoken"])
@pytest.mark.parametrize("normalize", [True, False])
def test_bert_equals_sentence_transformers(tmp_path, pooling, normalize):
    path = build_bert(tmp_path / "m", pooling=pooling, normalize=normalize, seed=3)
    ref = st_model(path).encode(SENTENCES, convert_to_tensor=True)
    llm = LLM(str(path), dtype="float32")
    assert llm.engine.pooling.normalize is normalize
    assert_close(embed(llm, SENTENCES), ref)  # one batch of different lengths
    assert_close(torch.cat([embed(llm, s) for s in SENTENCES]), ref)  # one by one


def test_bert_hidden_states_equal_transformers(bert_dir):
    """The encoder itself, before pooling: every token's state equals transformers' BertModel's."""
    from transformers import AutoTokenizer, BertModel

    from fw.layers.encoder import EncoderMetadata

    hf = BertModel.from_pretrained(str(bert_dir)).eval()
    tok = AutoTokenizer.from_pretrained(str(bert_dir))
    batch = tok(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        ref = hf(**batch).last_hidden_state
    llm = LLM(str(bert_dir), dtype="float32")
    ids = [tok(s).input_ids for s in SENTENCES]
    meta = EncoderMetadata.build([len(i) for i in ids], torch.device("cpu"))
    with torch.inference_mode():
        hidden = llm.engine.loaded.model(torch.tensor(sum(ids, [])), meta.positions, meta)
    for i, start in enumerate(meta.cu_seqlens[:-1].tolist()):
        n = len(ids[i])
        torch.testing.assert_close(hidden[start:start + n], ref[i, :n], atol=2e-5, rtol=1e-4)


def test_batches_split_by_the_token_budget_and_batch_size_give_the_same_vectors(bert_dir):
    whole = embed(LLM(str(bert_dir), dtype="float32"), SENTENCES)
    small = LLM(str(bert_dir), dtype="float32", max_batch_input_tokens=24, max_batch_size=2)
    steps = []
    original = small.engine.step
    small.engine.step = lambda: steps.append(len(out := original())) or out
    assert_close(embed(small, SENTENCES), whole, atol=1e-5)
    assert 3 <= len(steps) and max(steps) <= 2


def test_token_ids_equal_text(bert_dir):
    llm = LLM(str(bert_dir), dtype="float32")
    ids = [llm.tokenizer(s).input_ids for s in SENTENCES[:3]]
    assert_close(embed(llm, ids), embed(llm, SENTENCES[:3]), atol=1e-6)
    assert_close(embed(llm, {"prompt_token_ids": ids[0]}), embed(llm, SENTENCES[0]), atol=1e-6)


def test_padding_and_truncation_in_tokenizer_json_are_not_applied(tmp_path, monkeypatch):
    """sentence-transformers' tokenizer.json files pad every input to a fixed length and truncate it
    (all-MiniLM-L6-v2's: 128): transformers turns both off for a plain call, and so does fw, on the first
    load and on the load of its recorded snapshot (padding tokens would be pooled into the vector)."""
    from transformers import AutoTokenizer

    from fw.model.fast_tokenizer import FastTokenizer
    from fw.model.hf import load_tokenizer

    monkeypatch.setenv("FW_CACHE_DIR", str(tmp_path / "cache"))
    model = build_bert(tmp_path / "m")
    spec = json.loads((model / "tokenizer.json").read_text())
    spec["padding"] = {"strategy": {"Fixed": 32}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 0,
                       "pad_type_id": 0, "pad_token": "[PAD]"}
    spec["truncation"] = {"direction": "Right", "max_length": 6, "strategy": "LongestFirst", "stride": 0}
    (model / "tokenizer.json").write_text(json.dumps(spec))
    expected = AutoTokenizer.from_pretrained(str(model))(SENTENCES).input_ids
    assert max(map(len, expected)) > 6 and min(map(len, expected)) < 32
    first, recorded = load_tokenizer(model, False), load_tokenizer(model, False)
    assert isinstance(recorded, FastTokenizer)
    for tokenizer in (first, recorded):
        assert tokenizer(SENTENCES).input_ids == expected
        assert [tokenizer.encode(s) for s in SENTENCES] == expected


def test_without_sentence_transformers_files_bert_pools_cls_and_normalises(tmp_path):
    from transformers import AutoTokenizer, BertModel

    path = build_bert(tmp_path / "plain", pooling=None)
    llm = LLM(str(path), dtype="float32")
    assert (llm.engine.pooling.method, llm.engine.pooling.normalize) == ("cls", True)
    hf, tok = BertModel.from_pretrained(str(path)).eval(), AutoTokenizer.from_pretrained(str(path))
    with torch.no_grad():
        cls = torch.cat([hf(**tok(s, return_tensors="pt")).last_hidden_state[:, 0] for s in SENTENCES])
    assert_close(embed(llm, SENTENCES), F.normalize(cls, dim=-1))


def test_pooling_and_normalize_flags_override_the_files(bert_dir):
    llm = LLM(str(bert_dir), dtype="float32", pooling="cls", normalize_embeddings=False)
    assert (llm.engine.pooling.method, llm.engine.pooling.normalize) == ("cls", False)
    reference = LLM(str(bert_dir), dtype="float32")
    st = st_model(bert_dir)
    tokens = st.tokenize(SENTENCES[:2])
    with torch.no_grad():
        states = st[0](tokens)["token_embeddings"][:, 0]
    assert_close(embed(llm, SENTENCES[:2]), states)
    assert not torch.allclose(embed(llm, SENTENCES[:2]), embed(reference, SENTENCES[:2]))


def test_inputs_longer_than_max_seq_length_are_refused(bert_dir):
    llm = LLM(str(bert_dir), dtype="float32")
    assert llm.engine.max_length == 64  # sentence_bert_config.json's max_seq_length
    with pytest.raises(PromptTooLongError, match="more than the 64"):
        llm.embed("river " * 80)
    assert not llm.engine.has_unfinished_requests()
    assert LLM(str(bert_dir), dtype="float32", max_length=128).embed("river " * 80)


# -- Matryoshka dimensions ------------------------------------------------------------------------


def test_dimensions_need_a_matryoshka_model(bert_dir, tmp_path):
    plain = LLM(str(bert_dir), dtype="float32")
    with pytest.raises(InvalidRequestError, match="not Matryoshka") as err:
        plain.embed("a river", PoolingParams(dimensions=16))
    assert err.value.param == "dimensions"
    assert len(embed(plain, "a river", dimensions=64)[0]) == 64  # the full size is no truncation

    path = build_bert(tmp_path / "mrl", is_matryoshka=True)
    llm = LLM(str(path), dtype="float32")
    full = embed(llm, SENTENCES, dimensions=None)
    short = embed(llm, SENTENCES, dimensions=16)
    unnormalised = st_model(path).encode(SENTENCES, convert_to_tensor=True, normalize_embeddings=False)
    assert_close(short, F.normalize(F.normalize(unnormalised, dim=-1)[:, :16], dim=-1))
    assert_close(short, F.normalize(full[:, :16], dim=-1))
    with pytest.raises(InvalidRequestError, match="not one"):
        llm.embed("a river", PoolingParams(dimensions=65))


def test_matryoshka_dimensions_list_limits_the_sizes(tmp_path):
    path = build_bert(tmp_path / "mrl", matryoshka_dimensions=[16, 32, 64])
    llm = LLM(str(path), dtype="float32")
    assert embed(llm, "a river", dimensions=32).shape == (1, 32)
    with pytest.raises(InvalidRequestError, match="16, 32, 64"):
        llm.embed("a river", PoolingParams(dimensions=20))
    with pytest.raises(InvalidRequestError, match="positive integer"):
        PoolingParams(dimensions=0)


# -- what an encoder refuses ----------------------------------------------------------------------


def test_an_encoder_does_not_generate(bert_dir):
    from fw import SamplingParams

    llm = LLM(str(bert_dir), dtype="float32")
    with pytest.raises(InvalidRequestError, match="encoder-only embedding model"):
        llm.generate("a river", SamplingParams(max_tokens=2))
    with pytest.raises(ConfigError, match="--task generate: the bert architecture is an encoder-only"):
        LLM(str(bert_dir), task="generate")


def test_unsupported_sentence_transformers_module_is_refused_by_name(tmp_path):
    path = build_bert(tmp_path / "dense")
    modules = json.loads((path / "modules.json").read_text())
    modules.insert(2, {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ModelLoadError, match="sentence_transformers.models.Dense"):
        LLM(str(path), dtype="float32")


def test_bert_checkpoints_with_the_bert_prefix_load(tmp_path, bert_dir):
    """BertFor* checkpoints keep the encoder under `bert.` and add heads: the encoder loads, heads are skipped."""
    from safetensors.torch import load_file, save_file

    path = build_bert(tmp_path / "prefixed")
    tensors = load_file(str(path / "model.safetensors"))
    prefixed = {f"bert.{k}": v for k, v in tensors.items()}
    prefixed["cls.predictions.bias"] = torch.zeros(3)
    save_file(prefixed, str(path / "model.safetensors"))
    assert_close(embed(LLM(str(path), dtype="float32"), SENTENCES[:2]),
                 st_model(bert_dir).encode(SENTENCES[:2], convert_to_tensor=True), min_cos=-1, atol=10)


# -- decoders served as embedders (--task embed) --------------------------------------------------


PROMPTS = ["The engine schedules every request in pages.", "Once upon a time", "Paris is the capital of France. "
           "Berlin is the capital of Germany. Rome is the capital of Italy.", "a"]


def hf_pooled(hf_model, path, tokenizer, method: str) -> torch.Tensor:
    model = hf_model(path)
    rows = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([tokenizer(p).input_ids])
            states = model.model(input_ids=ids).last_hidden_state[0]
            rows.append(states[-1] if method == "last" else states.mean(0))
    return F.normalize(torch.stack(rows), dim=-1)


@pytest.mark.parametrize("method", ["last", "mean"])
def test_decoder_embeddings_equal_transformers_hidden_states(gqa_dir, hf_model, tokenizer, method):
    llm = make_llm(gqa_dir, task="embed", pooling=method)
    assert type(llm.engine).__name__ == "LLMEngine"
    assert llm.engine.blocks.enable_prefix_caching is (method == "last")  # mean reads every position
    ref = hf_pooled(hf_model, gqa_dir, tokenizer, method)
    assert_close(embed(llm, PROMPTS), ref)
    assert_close(torch.cat([embed(llm, p) for p in PROMPTS]), ref)
    # chunked prefill: the pooled state is folded in chunk by chunk
    chunked = make_llm(gqa_dir, task="embed", pooling=method, prefill_chunk_size=5, max_batch_input_tokens=8)
    assert_close(embed(chunked, PROMPTS), ref)
    assert not chunked.engine.has_unfinished_requests()


def test_decoder_embeddings_survive_preemption(gqa_dir, hf_model, tokenizer):
    """With few pages, sequences are preempted mid-prefill and recompute from the start: the pool starts over."""
    llm = make_llm(gqa_dir, task="embed", pooling="mean", num_kv_blocks=16, kv_cache_page_size=4,
                   prefill_chunk_size=3, max_batch_input_tokens=12)
    assert_close(embed(llm, PROMPTS * 2), hf_pooled(hf_model, gqa_dir, tokenizer, "mean").repeat(2, 1))
    assert llm.engine.stats()["num_preemptions"] > 0


def test_decoder_task_is_one_or_the_other(llm, gqa_dir):
    from fw import SamplingParams

    with pytest.raises(InvalidRequestError, match="start it with --task embed"):
        llm.embed("Once upon a time")
    embedder = make_llm(gqa_dir, task="embed")
    with pytest.raises(InvalidRequestError, match="served for embeddings"):
        embedder.generate("Once upon a time", SamplingParams(max_tokens=2))
    assert embedder.engine.pooling.method == "last"  # a decoder's default


def test_doctor_says_what_an_encoder_runs_with(capsys, bert_dir):
    import json as json_module

    from fw.cli.main import main

    assert main(["doctor", "--json", "--model", str(bert_dir)]) == 0
    report = json_module.loads(capsys.readouterr().out)
    resolved = {row["name"]: row["resolved"]["value"] for row in report["config"] if "resolved" in row}
    assert (resolved["task"], resolved["pooling"], resolved["normalize_embeddings"]) == ("embed", "mean", True)
    assert resolved["max_length"] == 64  # sentence_bert_config.json's max_seq_length
    assert "BidirectionalAttention" in report["selections"]["attention_backend"]["skipped"]
    assert main(["doctor", "--model", str(bert_dir), "--task", "generate"]) != 0
    assert "encoder-only embedding model" in capsys.readouterr().out
