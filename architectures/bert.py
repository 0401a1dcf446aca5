"""BERT encoders (`BertModel`): the sentence-transformers family (all-MiniLM-L6-v2, bge, e5, gte, ...).

An encoder-only architecture (`task="embed"`): no KV cache, bidirectional attention within each
sequence, absolute position and token-type embeddings, LayerNorm after each residual add (post-LN).
fw.pooling's encoder engine runs it and pools its hidden states into embeddings; the pooling and
normalisation come from the checkpoint's sentence-transformers files, else CLS (BERT's own
convention, as vLLM's BertEmbeddingModel)."""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from fw.layers import ACTIVATIONS, BidirectionalAttention, EncoderMetadata, Linear, ModelContext, load_named_weights
from fw.plugins import ArchitectureSpec, ModelConfig, hookimpl

FW_PLUGIN_API_VERSION = "1.5"

# HF's separate q/k/v -> fw's fused projection
FUSED_QKV = {
    ".attention.self.query.": (".attention.qkv.", 0),
    ".attention.self.key.": (".attention.qkv.", 1),
    ".attention.self.value.": (".attention.qkv.", 2),
}
# checkpoint tensors an embedding model does not use: BERT's pooler head (sentence-transformers pools
# itself), masked-LM / NSP heads, and old checkpoints' saved position-id buffer
UNUSED = ("pooler.", "cls.", "embeddings.position_ids")


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ModelContext):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=ctx.dtype)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size, dtype=ctx.dtype)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size, dtype=ctx.dtype)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, cfg.norm_eps, dtype=ctx.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: EncoderMetadata) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        if meta.token_type_ids is None:
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(meta.token_type_ids)
        return self.LayerNorm(x)


class BertAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ModelContext, prefix: str):
        super().__init__()
        self.size = cfg.hidden_size
        self.qkv = Linear(cfg.hidden_size, [cfg.hidden_size] * 3, ctx, f"{prefix}.qkv", bias=True)
        self.attn = BidirectionalAttention(cfg.num_attention_heads, cfg.head_dim)
        self.output = BertResidualOutput(cfg.hidden_size, cfg.hidden_size, cfg, ctx, f"{prefix}.output")

    def forward(self, x: torch.Tensor, meta: EncoderMetadata) -> torch.Tensor:
        qkv = self.qkv(x)
        s = self.size
        return self.output(self.attn(qkv[:, :s], qkv[:, s:2 * s], qkv[:, 2 * s:], meta), x)


class BertResidualOutput(nn.Module):
    """LayerNorm(dense(x) + residual): the post-LN step after attention and after the MLP."""

    def __init__(self, input_size: int, hidden_size: int, cfg: ModelConfig, ctx: ModelContext, prefix: str):
        super().__init__()
        self.dense = Linear(input_size, hidden_size, ctx, f"{prefix}.dense", bias=True)
        self.LayerNorm = nn.LayerNorm(hidden_size, cfg.norm_eps, dtype=ctx.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertIntermediate(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ModelContext, prefix: str):
        super().__init__()
        if cfg.hidden_act not in ACTIVATIONS:
            raise ValueError(f"BERT hidden_act {cfg.hidden_act!r} is not supported "
                             f"(supported: {', '.join(ACTIVATIONS)})")
        self.dense = Linear(cfg.hidden_size, cfg.intermediate_size, ctx, f"{prefix}.dense", bias=True)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ModelContext, prefix: str):
        super().__init__()
        self.attention = BertAttention(cfg, ctx, f"{prefix}.attention")
        self.intermediate = BertIntermediate(cfg, ctx, f"{prefix}.intermediate")
        self.output = BertResidualOutput(cfg.intermediate_size, cfg.hidden_size, cfg, ctx, f"{prefix}.output")

    def forward(self, x: torch.Tensor, meta: EncoderMetadata) -> torch.Tensor:
        x = self.attention(x, meta)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ModelContext):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg, ctx, f"encoder.layer.{i}") for i in range(cfg.num_hidden_layers))


class BertModel(nn.Module):
    """(input_ids [T], positions [T], EncoderMetadata) -> final hidden states [T, hidden]."""

    def __init__(self, cfg: ModelConfig, ctx: ModelContext):
        super().__init__()
        cfg = ModelConfig.from_hf(cfg).require(
            "norm_eps", "intermediate_size", "hidden_act", "max_position_embeddings", "type_vocab_size")
        if cfg.position_embedding_type != "absolute":
            raise ValueError(f"BERT position_embedding_type {cfg.position_embedding_type!r} is not supported "
                             f"(only absolute)")
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg, ctx)
        self.encoder = BertEncoder(cfg, ctx)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: EncoderMetadata) -> torch.Tensor:
        x = self.embeddings(input_ids, positions, meta)
        for layer in self.encoder.layer:
            x = layer(x, meta)
        return x

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # BertFor* checkpoints put the encoder under "bert."; BertModel ones at the root
        renamed = ((n.removeprefix("bert."), t) for n, t in weights)
        return load_named_weights(self, renamed, fused=FUSED_QKV, skip=UNUSED)


def build(cfg: ModelConfig, ctx: ModelContext, max_positions: int | None = None) -> BertModel:
    return BertModel(cfg, ctx)


@hookimpl
def fw_register_architectures(register) -> None:
    register(ArchitectureSpec(
        name="bert",
        hf_architectures=("BertModel",),
        build=build,
        description="BERT encoders (sentence-transformers models): embeddings only",
        task="embed",
        default_pooling="cls",
        build_config="model",
    ))
