"""The checkpoint's config class. No transformers class describes ParallelLM, so the plugin
brings its own and registers it with transformers' `AutoConfig` under the config's
``model_type``: fw (and any other AutoConfig user) then reads a ParallelLM `config.json`
like any Hugging Face one, with typed, validated fields."""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import AutoConfig, PreTrainedConfig

MODEL_TYPE = "fw_parallel_lm"
ARCHITECTURE = "ParallelLMForCausalLM"


@strict
class ParallelLMConfig(PreTrainedConfig):
    """Hyper-parameters of a ParallelLM checkpoint (`config.json`: ``"model_type": "fw_parallel_lm"``)."""

    model_type = MODEL_TYPE

    vocab_size: int = 32000
    hidden_size: int = 1024
    intermediate_size: int = 2816
    num_hidden_layers: int = 16
    num_attention_heads: int = 16
    num_key_value_heads: int | None = None  # None: as many as query heads (no GQA)
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    hidden_act: str = "silu"
    norm_eps: float = 1e-5  # the blocks' LayerNorms and the per-head QK RMSNorms
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        super().__post_init__(**kwargs)


# Registering twice is harmless (the plugin may be both installed and named by --custom-architectures).
AutoConfig.register(MODEL_TYPE, ParallelLMConfig, exist_ok=True)
