"""Qwen2 and Qwen3 (dense): a Llama-shaped decoder where the attention differs.

Qwen2 has biases on the q/k/v projections (not on o_proj) and may slide a
window over the layers from `max_window_layers` on when `use_sliding_window`
is set; transformers 5 states the result per layer in `config.layer_types`,
which is what this file reads. Qwen3 drops the biases (unless
`attention_bias`), normalises q and k per head (RMSNorm before rotary), and
states `head_dim` explicitly (it need not be hidden_size / heads)."""

from __future__ import annotations

from fw.layers import CausalLM, DecoderModel, GatedMLP, ModelContext, PreNormDecoderLayer, RMSNorm, SelfAttention
from fw.plugins import ArchitectureSpec, ModelConfig, hookimpl

FW_PLUGIN_API_VERSION = "1.5"


def layer_window(cfg: ModelConfig, index: int) -> int | None:
    """Layer `index`'s sliding window as transformers decides it (None: full attention). Its config
    class fills `layer_types` from use_sliding_window / max_window_layers and clears
    `sliding_window` when use_sliding_window is false."""
    return cfg.sliding_window if cfg.layer_types_checked()[index] == "sliding_attention" else None


class QwenDecoderLayer(PreNormDecoderLayer):
    def __init__(self, cfg: ModelConfig, ctx: ModelContext, prefix: str, index: int, qwen3: bool):
        super().__init__()
        if qwen3:
            bias = cfg.attention_bias
            options = dict(qkv_bias=bias, o_bias=bias, qk_norm_eps=cfg.norm_eps)
        else:
            options = dict(qkv_bias=True, o_bias=False)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, ctx.dtype)
        self.self_attn = SelfAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                       cfg.head_dim, ctx, f"{prefix}.self_attn",
                                       sliding_window=layer_window(cfg, index), **options)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, ctx.dtype)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, ctx, f"{prefix}.mlp", hidden_act=cfg.hidden_act)


class QwenForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, ctx: ModelContext, max_positions: int | None = None, qwen3: bool = False):
        cfg = ModelConfig.from_hf(cfg).require("norm_eps", "intermediate_size", "hidden_act")
        layers = (QwenDecoderLayer(cfg, ctx, f"model.layers.{i}", i, qwen3) for i in range(cfg.num_hidden_layers))
        super().__init__(cfg, ctx, DecoderModel(cfg, ctx, max_positions or cfg.max_position_embeddings, layers))


def build_qwen2(cfg: ModelConfig, ctx: ModelContext, max_positions: int | None = None) -> QwenForCausalLM:
    return QwenForCausalLM(cfg, ctx, max_positions, qwen3=False)


def build_qwen3(cfg: ModelConfig, ctx: ModelContext, max_positions: int | None = None) -> QwenForCausalLM:
    return QwenForCausalLM(cfg, ctx, max_positions, qwen3=True)


@hookimpl
def fw_register_architectures(register) -> None:
    register(ArchitectureSpec(
        name="qwen2",
        hf_architectures=("Qwen2ForCausalLM",),
        build=build_qwen2,
        build_config="model",
        description="Qwen2 / Qwen2.5 (q/k/v biases; sliding window from max_window_layers when enabled)",
    ))
    register(ArchitectureSpec(
        name="qwen3",
        hf_architectures=("Qwen3ForCausalLM",),
        build=build_qwen3,
        build_config="model",
        description="Qwen3 dense (per-head QK RMSNorm, explicit head_dim)",
    ))
