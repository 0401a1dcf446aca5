"""fw.model.config: the Hugging Face config read once, its defaults in one place, missing fields refused;
and the rule that layers and architectures read nothing else."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fw.errors import ModelLoadError
from fw.layers.rotary import rope_inv_freq
from fw.model.config import ModelConfig, RopeConfig, as_model_config

ROOT = Path(__file__).resolve().parents[1]


def _plain(**fields) -> SimpleNamespace:
    """A config object with only the given attributes (no transformers class filling defaults)."""
    base = dict(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    return SimpleNamespace(**{**base, **fields})


def test_documented_defaults_apply_where_the_config_is_silent():
    cfg = ModelConfig.from_hf(_plain())
    assert (cfg.num_key_value_heads, cfg.head_dim) == (4, 16)
    assert cfg.rope == RopeConfig("default", 10000.0, 1.0)
    assert (cfg.intermediate_size, cfg.norm_eps, cfg.hidden_act, cfg.tie_word_embeddings, cfg.moe) == (None,) * 5
    assert not cfg.attention_bias and cfg.position_embedding_type == "absolute"


def test_rope_base_is_read_where_transformers_5_keeps_it():
    """transformers 5 moved rope_theta into rope_parameters; the top-level key is read only without it."""
    from transformers import LlamaConfig

    cfg = ModelConfig.from_hf(LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                                          rope_parameters={"rope_type": "default", "rope_theta": 100000.0}))
    assert cfg.rope.theta == 100000.0
    old = ModelConfig.from_hf(_plain(rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 2.0},
                                     max_position_embeddings=256))
    assert (old.rope.rope_type, old.rope.theta, old.rope.max_position_embeddings) == ("linear", 500000.0, 256)
    assert old.rope.parameters["factor"] == 2.0 and old.rope.parameters["rope_theta"] == 500000.0
    linear, _ = rope_inv_freq(old, 16)  # through transformers' initialiser: the default's frequencies / factor
    default, _ = rope_inv_freq(RopeConfig(theta=500000.0), 16)
    assert torch.allclose(linear, default / 2.0)


def test_one_config_per_spelling():
    from transformers import BertConfig, Gemma2Config, Gemma3TextConfig, MixtralConfig, Qwen2MoeConfig

    assert ModelConfig.from_hf(BertConfig(layer_norm_eps=1e-7)).norm_eps == 1e-7
    assert ModelConfig.from_hf(_plain(norm_eps=1e-4)).norm_eps == 1e-4  # a plugin's own config class
    assert ModelConfig.from_hf(Gemma2Config(hidden_activation="gelu")).hidden_act == "gelu"
    gemma3 = ModelConfig.from_hf(Gemma3TextConfig())
    assert set(gemma3.layer_ropes) == {"sliding_attention", "full_attention"}
    assert gemma3.rope_for("sliding_attention").theta == 10000.0 and gemma3.rope_for("full_attention").theta == 1e6
    mixtral = ModelConfig.from_hf(MixtralConfig(intermediate_size=96, num_local_experts=4))
    assert (mixtral.moe.num_experts, mixtral.moe.intermediate_size, mixtral.moe.is_sparse(0)) == (4, 96, True)
    qwen = ModelConfig.from_hf(Qwen2MoeConfig(moe_intermediate_size=32, mlp_only_layers=[1], decoder_sparse_step=1))
    assert qwen.moe.intermediate_size == 32 and not qwen.moe.is_sparse(1) and qwen.moe.is_sparse(0)


def test_a_missing_field_without_a_safe_default_is_named_with_the_model():
    incomplete = _plain(_name_or_path="org/tiny")
    del incomplete.hidden_size
    with pytest.raises(ModelLoadError, match=r"org/tiny: the model config lacks hidden_size"):
        ModelConfig.from_hf(incomplete)
    with pytest.raises(ModelLoadError, match="does not divide into 3 attention heads.*add head_dim"):
        ModelConfig.from_hf(_plain(num_attention_heads=3))
    with pytest.raises(ModelLoadError, match="names 4 experts but no num_experts_per_tok"):
        ModelConfig.from_hf(_plain(num_local_experts=4, intermediate_size=8))


def test_an_architecture_refuses_a_field_it_needs_and_fw_does_not_default():
    from fw.architectures.llama import build

    cfg = ModelConfig.from_hf(_plain(_name_or_path="org/tiny", rms_norm_eps=1e-5, hidden_act="silu"))
    with pytest.raises(ModelLoadError, match="org/tiny: the model config lacks intermediate_size"):
        build(cfg, None, 64)


def test_a_model_config_pickles_and_deep_copies():
    """A model holds its config (CausalLM.config): torch.save(model) and copy.deepcopy(model) need it to."""
    import copy
    import pickle

    from transformers import Gemma3TextConfig

    cfg = ModelConfig.from_hf(Gemma3TextConfig())
    for clone in (pickle.loads(pickle.dumps(cfg)), copy.deepcopy(cfg)):
        assert clone == cfg and clone.rope_for("sliding_attention").parameters == cfg.layer_ropes[
            "sliding_attention"].parameters


def test_as_model_config_passes_a_model_config_through():
    cfg = ModelConfig.from_hf(_plain())
    assert as_model_config(cfg) is cfg and ModelConfig.from_hf(cfg) is cfg


# Files where these names are not a model's config read field by field with a default: fw's EngineConfig
# (distributed), torch._dynamo's config (compile), the testing kit's factory of tiny transformers
# checkpoints (it builds HF models), the recorded copy of a transformers config (every attribute, by
# name) and the scaffold's port of a transformers class (it inspects the class it ports).
NOT_AN_HF_CONFIG = {"core/distributed/rendezvous.py", "core/distributed/checks.py", "core/compile/isolated.py",
                    "core/testing/models.py", "core/model/config_snapshot.py", "core/commands/scaffold/port.py"}


def test_no_layer_or_architecture_reads_the_raw_hf_config():
    """The issue's grep: `getattr(cfg` / `getattr(config` on an HF config only inside fw.model.config; and
    the native architectures and shared layers hold no `getattr` on any config name at all."""
    pattern = re.compile(r"getattr\((cfg|config)\b")
    strict = re.compile(r"getattr\((cfg|config|hf_config|hf)\b")
    offenders = []
    for folder in ("architectures", "core", "backends", "quantizers"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            layer_or_arch = rel.startswith(("core/layers/", "architectures/")) and not rel.endswith(
                "transformers_fallback.py")  # the fallback runs transformers' own classes on the HF config
            rule = strict if layer_or_arch else pattern
            if rel == "core/model/config.py" or (rel in NOT_AN_HF_CONFIG and not layer_or_arch):
                continue
            offenders += [f"{rel}:{n}: {line.strip()}" for n, line in enumerate(path.read_text().splitlines(), 1)
                          if rule.search(line)]
    assert not offenders, "read the model's config through fw.model.config.ModelConfig:\n" + "\n".join(offenders)
