"""`fw plugins new --kind architecture --hf-class X`: the port of transformers' OLMo 2 (post-norm
layers, q/k RMSNorm over all heads, norms that scale in fp32) from a tiny config matches
transformers' Olmo2ForCausalLM (the oracle) at fp32; what the blocks cannot express is
refused; and a NAME that would claim an existing transformers class with a Llama body is refused.
(bf16 parity of the norms' rounding order: tests/test_norm.py.)"""

from __future__ import annotations

import importlib
import sys

import pytest
import transformers

from fw.errors import ConfigError
from fw.commands.scaffold import new_plugin
from fw.commands.scaffold.port import inspect_hf_class
from fw.testing import greedy_reference, load_reference, tiny_checkpoint, tokenizer

PROMPTS = ["The quick brown fox jumps over", "def add(a, b):", "Once upon a time, in a small village"]


@pytest.fixture(scope="module")
def olmo2_port(tmp_path_factory):
    """The generated package, importable (not installed: fw takes it through --custom-architectures)."""
    root = new_plugin("architecture", "olmo2-port", tmp_path_factory.mktemp("port"), hf_class="Olmo2ForCausalLM")
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()
    yield root
    sys.path.remove(str(root))


@pytest.fixture(scope="module")
def olmo2_checkpoint(tmp_path_factory):
    tok = tokenizer()
    config = transformers.Olmo2Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False,
        architectures=["Olmo2ForCausalLM"])
    return tiny_checkpoint(None, tmp_path_factory.mktemp("olmo2") / "ckpt", hf_config=config)


def test_port_reads_olmo2_from_transformers():
    port = inspect_hf_class("Olmo2ForCausalLM")
    assert (port.config_class, port.layer, port.qk_norm, port.rounding) == \
        ("Olmo2Config", "post_norm", "full", "scale_then_round")
    qwen3 = inspect_hf_class("Qwen3ForCausalLM")
    assert (qwen3.layer, qwen3.qk_norm, qwen3.rounding) == ("pre_norm", "head", "round_then_scale")
    qwen2 = inspect_hf_class("Qwen2ForCausalLM")
    assert (qwen2.qkv_bias, qwen2.o_bias) == ("True", "False")  # Qwen2: biases on q/k/v only, no config field


def test_generated_port_uses_transformers_config_and_oracle(olmo2_port):
    package = olmo2_port / "fw_olmo2_port"
    assert not (package / "config.py").exists()  # no invented config class
    model = (package / "model.py").read_text()
    assert "PostNormDecoderLayer" in model and 'qk_norm_width="full"' in model
    assert 'ROUNDING = "scale_then_round"' in model
    test = (olmo2_port / "tests" / "test_fw_olmo2_port.py").read_text()
    assert "transformers.Olmo2Config(" in test and 'architectures=["Olmo2ForCausalLM"]' in test
    assert 'FW_PLUGIN_API_VERSION = "1.5"' in (package / "plugin.py").read_text()


def test_olmo2_port_matches_transformers(olmo2_port, olmo2_checkpoint):
    from fw import LLM, SamplingParams

    llm = LLM(str(olmo2_checkpoint), dtype="float32", num_kv_blocks=64, kv_cache_page_size=4, prefill_chunk_size=5,
              max_batch_input_tokens=12, custom_architectures=["fw_olmo2_port.plugin"])
    assert llm.engine.loaded.architecture.name == "olmo2-port"
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1))
    reference = load_reference(olmo2_checkpoint)
    for prompt, out in zip(PROMPTS, outs):
        want, ref_logprobs = greedy_reference(reference, tokenizer()(prompt).input_ids, 8)
        got = out.outputs[0]
        assert got.token_ids == want, prompt
        worst = max(abs(e[t].logprob - r[t].item()) for e, r, t in zip(got.logprobs, ref_logprobs, want))
        assert worst < 1e-3, f"{prompt!r}: worst logprob difference {worst:.2e}"


def test_existing_transformers_class_is_not_claimed_with_a_llama_body(tmp_path):
    with pytest.raises(ConfigError, match=r"NAME 'olmo2' would register Olmo2ForCausalLM, which transformers already "
                                          r"defines.*--kind architecture --hf-class Olmo2ForCausalLM olmo2"):
        new_plugin("architecture", "olmo2", tmp_path)
    with pytest.raises(ConfigError, match="Olmo2ForCausalLM is already served by the installed architecture 'x'"):
        new_plugin("architecture", "my-olmo", tmp_path, hf_class="Olmo2ForCausalLM", served={"Olmo2ForCausalLM": "x"})
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("hf_class, why", [
    ("GemmaForCausalLM", "its embedding is a GemmaTextScaledWordEmbedding"),
    ("Gemma2ForCausalLM", "its config sets attn_logit_softcapping"),
    ("MixtralForCausalLM", "its config sets num_experts"),
    ("GPT2LMHeadModel", "not a causal-LM class of transformers"),
    ("NoSuchForCausalLM", "not a causal-LM class of transformers"),
])
def test_what_the_blocks_cannot_express_is_refused(hf_class, why, tmp_path):
    with pytest.raises(ConfigError, match=why):
        new_plugin("architecture", "ported", tmp_path, hf_class=hf_class)
    assert not any(tmp_path.iterdir())


def test_hf_class_needs_the_architecture_kind(tmp_path):
    with pytest.raises(ConfigError, match="--hf-class ports a transformers architecture: use it with --kind "
                                          "architecture, not sampler"):
        new_plugin("sampler", "s", tmp_path, hf_class="Olmo2ForCausalLM")


def test_kit_checks_its_vocabulary_floor_up_front():
    """A config narrower than the kit tokenizer's 512 ids is refused when the suite is built (at
    collection), not with an embedding index error mid-run."""
    from fw.testing import VOCAB_SIZE, conformance_suite

    small = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, architectures=["LlamaForCausalLM"])
    with pytest.raises(ValueError, match=r"conformance_suite\('architecture', hf_config=...\): the config's vocab_size "
                                         r"is 300, but the kit's tokenizer has 512 tokens.*set vocab_size=512"):
        conformance_suite("architecture", "llama", hf_config=small)
    assert VOCAB_SIZE == 512
