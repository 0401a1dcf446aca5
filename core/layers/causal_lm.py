"""The wrapper every decoder family shares around its `model`: the output
projection and checkpoint loading.

The output projection is the family's own `lm_head`, or the input embedding
when the config ties them (`tie_word_embeddings`); a tied head is packed for
CPU matmuls once the weights are in, because the embedding itself stays in
the plain layout its row lookups need."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import torch
from torch import nn

from fw.layers.blocks import FUSED_PROJECTIONS
from fw.layers.context import ModelContext
from fw.kernels import dense
from fw.kernels.dense import DenseLayout
from fw.layers.linear import Linear, UnquantizedLinearMethod
from fw.layers.weights import load_named_weights
from fw.model.config import ModelConfig, as_model_config

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class CausalLM(nn.Module):
    """`model` maps (input_ids, positions, attention metadata) to final hidden states and holds
    `embed_tokens`. Subclasses change `skip_weights`, `load_checkpoint` (say, for expert weights) or
    `compute_logits` (say, a final soft-cap) where their family differs. `tie_by_default`: whether
    the head is tied when the config does not say (Gemma ties, Llama does not)."""

    skip_weights: tuple[str, ...] = ("rotary_emb.inv_freq",)  # checkpoint names that are not parameters

    def __init__(self, cfg: ModelConfig | PretrainedConfig, ctx: ModelContext, model: nn.Module,
                 tie_by_default: bool = False):
        super().__init__()
        self.config = cfg
        self.model = model
        model_cfg = as_model_config(cfg)
        self.tie = tie_by_default if model_cfg.tie_word_embeddings is None else model_cfg.tie_word_embeddings
        cfg = model_cfg
        if not self.tie:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, ctx, "lm_head")
            self.lm_head.fp32_out = True
        self.device = ctx.device
        self.tied_head: torch.Tensor | None = None  # the embedding packed for CPU matmuls, after loading
        self.tied_head_layout = DenseLayout.PLAIN  # its layout (fw.kernels.dense), recorded when it is packed

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits: fw's bf16 CPU kernel's unrounded fp32 sums where it runs the (dense) head, else in
        the head's own dtype."""
        if self.tie:
            if self.tied_head is not None:
                return dense.logits(hidden, self.tied_head, self.tied_head_layout)
            return dense.logits(hidden, self.model.embed_tokens.weight, DenseLayout.PLAIN)
        if type(self.lm_head.method) is UnquantizedLinearMethod:
            return dense.logits(hidden, self.lm_head.weight, self.lm_head.dense_layout, self.lm_head.bias)
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = self.load_checkpoint(weights, self.skip_weights + (("lm_head.",) if self.tie else ()))
        if self.tie:
            embedding = self.model.embed_tokens.weight.data
            packed, layout = dense.pack_dense(embedding, self.device)
            self.tied_head, self.tied_head_layout = (packed, layout) if packed is not embedding else (None, layout)
        return loaded

    def load_checkpoint(self, weights: Iterable[tuple[str, torch.Tensor]], skip: tuple[str, ...]) -> set[str]:
        """Checkpoint tensors into parameters, q/k/v and gate/up into their fused projections."""
        return load_named_weights(self, weights, fused=FUSED_PROJECTIONS, skip=skip)
