"""Shared layers that architecture plugins build models from.

Linear layers delegate to a quantization method, attention layers to the
selected attention backend; norms and rotary embeddings follow Hugging Face
numerics so parity tests hold.
"""

from fw.layers.attention import Attention, AttentionBackend, AttentionMetadata
from fw.layers.blocks import (ACTIVATIONS, FUSED_PROJECTIONS, DecoderModel, GatedMLP, PostNormDecoderLayer,
                              PreNormDecoderLayer, SelfAttention)
from fw.layers.causal_lm import CausalLM
from fw.layers.context import ModelContext
from fw.kernels.dense import dense_linear, dense_logits, pack_dense_weight
from fw.layers.encoder import BidirectionalAttention, EncoderMetadata
from fw.layers.gguf_weight import GGUFWeight
from fw.layers.linear import LinearMethod, Linear, UnquantizedLinearMethod
from fw.layers.moe import (GATED_EXPERT_NAMES, MIXTRAL_EXPERT_NAMES, FusedExperts, MoeKernel, SparseMoeBlock,
                           TopKRouter, load_moe_weights, topk_routing)
from fw.layers.norm import RMSNorm
from fw.layers.rotary import RotaryEmbedding, apply_rotary, rotate_heads
from fw.layers.weights import default_weight_loader, load_named_weights, unpermute_gguf_qk

__all__ = [
    "Attention",
    "AttentionBackend",
    "AttentionMetadata",
    "ModelContext",
    "CausalLM",
    "ACTIVATIONS",
    "FUSED_PROJECTIONS",
    "GatedMLP",
    "DecoderModel",
    "PostNormDecoderLayer",
    "PreNormDecoderLayer",
    "SelfAttention",
    "BidirectionalAttention",
    "EncoderMetadata",
    "dense_linear",
    "dense_logits",
    "pack_dense_weight",
    "GGUFWeight",
    "Linear",
    "LinearMethod",
    "UnquantizedLinearMethod",
    "GATED_EXPERT_NAMES",
    "MIXTRAL_EXPERT_NAMES",
    "FusedExperts",
    "MoeKernel",
    "SparseMoeBlock",
    "TopKRouter",
    "load_moe_weights",
    "topk_routing",
    "RMSNorm",
    "RotaryEmbedding",
    "apply_rotary",
    "rotate_heads",
    "default_weight_loader",
    "load_named_weights",
    "unpermute_gguf_qk",
]
