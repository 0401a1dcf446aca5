"""Llama family: Llama 2/3.x, SmolLM/SmolLM2, TinyLlama, Mistral (with its sliding window).

Built from fw's shared layers: fused QKV and gate/up linears (delegating to the
quantization method), RMSNorm, rotary embedding (every HF rope type), and the
selected attention backend over the paged KV cache."""

from __future__ import annotations

from fw.layers import (CausalLM, DecoderModel, GatedMLP, ModelContext, PreNormDecoderLayer, RMSNorm, SelfAttention,
                       unpermute_gguf_qk)
from fw.plugins import ArchitectureSpec, ModelConfig, hookimpl

FW_PLUGIN_API_VERSION = "1.5"


class LlamaDecoderLayer(PreNormDecoderLayer):
    def __init__(self, cfg: ModelConfig, ctx: ModelContext, prefix: str):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, ctx.dtype)
        bias = cfg.attention_bias
        self.self_attn = SelfAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                       cfg.head_dim, ctx, f"{prefix}.self_attn", qkv_bias=bias, o_bias=bias,
                                       sliding_window=cfg.sliding_window)  # Mistral: every layer
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, ctx.dtype)
        if cfg.hidden_act != "silu":
            raise ValueError(f"Llama MLP supports hidden_act 'silu', not {cfg.hidden_act!r}")
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, ctx, f"{prefix}.mlp", bias=cfg.mlp_bias)


class LlamaForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, ctx: ModelContext, max_positions: int | None = None):
        # from_hf: a ModelConfig as is, or the transformers config a plugin subclassing this class hands it
        cfg = ModelConfig.from_hf(cfg).require("norm_eps", "intermediate_size")
        layers = (LlamaDecoderLayer(cfg, ctx, f"model.layers.{i}") for i in range(cfg.num_hidden_layers))
        super().__init__(cfg, ctx, DecoderModel(cfg, ctx, max_positions or cfg.max_position_embeddings, layers))


def build(cfg: ModelConfig, ctx: ModelContext, max_positions: int | None = None) -> LlamaForCausalLM:
    return LlamaForCausalLM(cfg, ctx, max_positions)


@hookimpl
def fw_register_architectures(register) -> None:
    register(ArchitectureSpec(
        name="llama",
        # Mistral is Llama plus a sliding window in every layer; its config states the window,
        # and a backend that cannot apply it rejects the model with that reason.
        hf_architectures=("LlamaForCausalLM", "MistralForCausalLM"),
        gguf_architectures=("llama",),
        build=build,
        gguf_weight_transform=unpermute_gguf_qk,
        description="Llama 2/3.x, SmolLM/SmolLM2, TinyLlama, Mistral (sliding window)",
        build_config="model",
    ))
