"""The attention and MLP blocks most decoder families share, so a family's file
only states where it differs (biases, QK-norm, the activation, a window).

Projections are fused at load: q/k/v into one `qkv_proj`, gate/up into one
`gate_up_proj`; `FUSED_PROJECTIONS` maps Hugging Face's checkpoint names onto
them for `load_named_weights`.

The per-token path calls submodules' `forward` directly rather than through
`nn.Module.__call__` (faster at batch 1: docs/performance.md). The cost: torch
forward hooks on these submodules do not fire; to observe or change
activations, subclass the block or override the architecture.

The layer protocol `DecoderModel` drives (docs/plugin-authors/blocks.md):
`layer.forward(x, residual, cos_sin, meta) -> (x, residual)`. A pre-norm layer
carries the residual stream separately so the next norm can add it (`residual`
is None only into the first layer); a post-norm layer returns `(hidden, None)`,
its output being the whole residual stream. `DecoderModel`'s final norm adds
whatever residual the last layer returned."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fw.distributed.group import tensor_parallel_of
from fw.errors import UnsupportedConfigurationError
from fw.layers.attention import Attention
from fw.layers.context import ModelContext
from fw.layers.norm import RMSNorm
from fw.layers.parallel import ColumnParallelLinear, RowParallelLinear, split_heads
from fw.kernels import cpu_ops
from fw.kernels.step_program import NotReplayable, emit, replays
from fw.layers import replay
from fw.layers.rotary import RotaryEmbedding, rotate_heads_
from fw.model.config import as_model_config

# checkpoint sub-name -> (fused sub-name, shard index)
FUSED_PROJECTIONS = {
    ".q_proj.": (".qkv_proj.", 0), ".k_proj.": (".qkv_proj.", 1), ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1),
}

# HF `hidden_act` names -> the activation applied to the gate
ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}


class SelfAttention(nn.Module):
    """Fused-QKV attention with rotary embedding over the paged KV cache.

    Options cover the families fw ships: projection biases (Qwen2), QK RMSNorm
    before rotary, per head (`qk_norm_width="head"`: Qwen3, Gemma 3) or over all
    heads at once (`"full"`: OLMo 2), a custom softmax scale (Gemma's
    `query_pre_attn_scalar`), a sliding window (Mistral, Gemma 2/3) and
    attention-logit soft-capping (Gemma 2). `qk_norm_rounding` is the q/k norms'
    `RMSNorm.rounding`.

    With tensor parallelism (fw.distributed) each rank computes num_heads / tp query heads and
    num_kv_heads / tp KV heads, their q/k/v columns and o_proj rows; o_proj sums over the ranks.
    Where the heads do not divide but the KV heads are at least as many as the ranks, the KV groups
    (a KV head and the query heads that read it) are dealt out unevenly: SmolLM2's 9 query and 3 KV
    heads at tp 2 give rank 0 two groups (6 + 2 heads) and rank 1 one (3 + 1). With fewer KV heads than ranks
    each KV head is replicated on the ranks that share it and each rank computes its own query heads of that
    head's group (4 query heads and 1 KV head at tp 2: 2 + 1 each). `fw.layers.parallel.split_heads`."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        ctx: ModelContext,
        prefix: str,
        *,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm_eps: float | None = None,
        qk_norm_weight_offset: float = 0.0,
        scale: float | None = None,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        qk_norm_width: str = "head",
        qk_norm_rounding: str | None = None,
    ):
        super().__init__()
        group = tensor_parallel_of(ctx)
        tp = group.size
        (q_first, q_heads), (kv_first, kv_heads) = split_heads(num_heads, num_kv_heads, tp, group.rank)
        q_part, kv_part = (q_first * head_dim, q_heads * head_dim), (kv_first * head_dim, kv_heads * head_dim)
        slices = [q_part, kv_part, kv_part]  # this rank's rows of q, k and v (its KV head's, when replicated)
        self.head_dim = head_dim
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = ColumnParallelLinear(hidden_size, [q_size, kv_size, kv_size], ctx, f"{prefix}.qkv_proj",
                                             bias=qkv_bias, slices=slices)
        self.o_proj = RowParallelLinear(q_size, hidden_size, ctx, f"{prefix}.o_proj", bias=o_bias,
                                        input_slice=q_part)
        self.q_size, self.kv_size = self.qkv_proj.output_sizes[0], self.qkv_proj.output_sizes[1]  # this rank's
        num_heads, num_kv_heads = self.q_size // head_dim, self.kv_size // head_dim
        self.q_norm = self.k_norm = None
        if qk_norm_width not in ("head", "full"):
            raise ValueError(f"SelfAttention qk_norm_width {qk_norm_width!r}: use 'head' (one norm per head) or "
                             "'full' (one norm over all heads' q, one over all heads' k)")
        self.qk_norm_full = qk_norm_width == "full"
        if qk_norm_eps is not None:
            if self.qk_norm_full and tp > 1:
                raise UnsupportedConfigurationError(
                    f"--tensor-parallel-size {tp}: this model normalises q and k over all heads at once, which "
                    "spans the ranks' head shards; run it with --tensor-parallel-size 1")
            q_width, k_width = (q_size, kv_size) if self.qk_norm_full else (head_dim, head_dim)
            self.q_norm = RMSNorm(q_width, qk_norm_eps, ctx.dtype, qk_norm_weight_offset, qk_norm_rounding)
            self.k_norm = RMSNorm(k_width, qk_norm_eps, ctx.dtype, qk_norm_weight_offset, qk_norm_rounding)
        self.attn = Attention(num_heads, num_kv_heads, head_dim, ctx, scale=scale,
                              sliding_window=sliding_window, logit_softcap=logit_softcap)

    def forward(self, x: torch.Tensor, cos_sin, meta) -> torch.Tensor:
        qkv = self.qkv_proj.forward(x)
        qk_end = self.q_size + self.kv_size
        if self.q_norm is None:
            qk = rotate_heads_(qkv[:, :qk_end], cos_sin, self.head_dim)  # q and k in one go
            q, k = qk[:, : self.q_size], qk[:, self.q_size:]  # slicing: Tensor.split is a slow Python path
        elif self.qk_norm_full:
            q, k = self.q_norm(qkv[:, : self.q_size]), self.k_norm(qkv[:, self.q_size: qk_end])
            q, k = rotate_heads_(q, cos_sin, self.head_dim), rotate_heads_(k, cos_sin, self.head_dim)
        else:
            t, d = x.shape[0], self.head_dim
            q = self.q_norm(qkv[:, : self.q_size].reshape(-1, d)).view(t, -1)
            k = self.k_norm(qkv[:, self.q_size: qk_end].reshape(-1, d)).view(t, -1)
            q, k = rotate_heads_(q, cos_sin, d), rotate_heads_(k, cos_sin, d)
        v = qkv[:, qk_end:]
        return self.o_proj.forward(self.attn.forward(q, k, v, meta))

    def emit_step(self, b, x):
        """`forward` as a step program's calls (fw.layers.replay), rotary on fw's CPU op."""
        replays(self, SelfAttention)
        if not cpu_ops.ready():
            raise NotReplayable("rotary off fw's fused CPU op")
        qkv = emit(self.qkv_proj, b, x)
        qk_end, d = self.q_size + self.kv_size, self.head_dim
        cos, sin = b.input("cos"), b.input("sin")
        if self.q_norm is None:
            qk = b.narrow(qkv, 0, qk_end)
            b.call("fw_cpu_ops::rotary", qk, cos, sin, d)
            q, k = b.narrow(qk, 0, self.q_size), b.narrow(qk, self.q_size, self.kv_size)
        elif self.qk_norm_full:  # OLMo 2's, whose post-norm layers are not replayed either
            raise NotReplayable("q/k norms over all heads")
        else:  # per head: [T * heads, d] through the norm, back to [T, heads * d]
            q, k = b.narrow(qkv, 0, self.q_size), b.narrow(qkv, self.q_size, self.kv_size)
            q = b.view(emit(self.q_norm, b, b.reshape(q, -1, d)), -1, rows_of=x)
            k = b.view(emit(self.k_norm, b, b.reshape(k, -1, d)), -1, rows_of=x)
            b.call("fw_cpu_ops::rotary", q, cos, sin, d)
            b.call("fw_cpu_ops::rotary", k, cos, sin, d)
        v = b.narrow(qkv, qk_end, self.kv_size)
        return emit(self.o_proj, b, self.attn.emit_step(b, q, k, v))


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one projection. With tensor parallelism
    each rank holds intermediate_size / tp of gate and up (column-parallel) and of down's inputs
    (row-parallel, summed over the ranks; `reduce_results=False` leaves the sum to the caller)."""

    def __init__(self, hidden_size: int, intermediate_size: int, ctx: ModelContext, prefix: str, *,
                 hidden_act: str = "silu", bias: bool = False, reduce_results: bool = True):
        super().__init__()
        if hidden_act not in ACTIVATIONS:
            raise ValueError(f"MLP activation {hidden_act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
        self.act = ACTIVATIONS[hidden_act]
        self.fusable = hidden_act in ("silu", "swish")  # cpu_ops.silu_mul
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [intermediate_size, intermediate_size], ctx,
                                                 f"{prefix}.gate_up_proj", bias=bias)
        self.gate_up_proj.silu_gate_up = self.fusable
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, ctx, f"{prefix}.down_proj", bias=bias,
                                           reduce_results=reduce_results)
        self.inter = self.down_proj.input_size  # this rank's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the activation fused into the product where the layer's method does it (fw's bf16 CPU kernel)
        fused = self.gate_up_proj.method.silu_mul(self.gate_up_proj, x) if self.fusable else None
        if fused is not None:
            return self.down_proj.forward(fused)
        gate_up = self.gate_up_proj.forward(x)
        if self.fusable and cpu_ops.usable(gate_up):
            return self.down_proj.forward(cpu_ops.silu_mul(gate_up))
        gate, up = gate_up.split(self.inter, dim=-1)
        return self.down_proj.forward(self.act(gate) * up)

    def emit_step(self, b, x):
        """`forward` as a step program's calls (fw.layers.replay): SiLU, in the product or fw's fused CPU op."""
        replays(self, GatedMLP)
        if not self.fusable:
            raise NotReplayable("an MLP activation other than SiLU")
        fused = self.gate_up_proj.method.emit_silu_step(self.gate_up_proj, b, x)
        if fused is not None:
            return emit(self.down_proj, b, fused)
        if not cpu_ops.ready():
            raise NotReplayable("SiLU off fw's fused CPU op")
        gate_up = emit(self.gate_up_proj, b, x)
        out = b.empty(gate_up, self.gate_up_proj.output_size // 2)
        b.call("fw_cpu_ops::silu_mul", gate_up, out)
        return emit(self.down_proj, b, out)


class PreNormDecoderLayer(nn.Module):
    """attention, then MLP, each after its RMSNorm, with the residual carried from layer to layer so each
    norm also does the residual add (the fused pre-norm pattern of Llama, Qwen, Mixtral and friends).
    Subclasses build `input_layernorm`, `self_attn`, `post_attention_layernorm` and `mlp`."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos_sin, meta):
        if residual is None:
            residual = x
            x = self.input_layernorm.forward(x)
        else:
            x, residual = self.input_layernorm.forward(x, residual)
        x = self.self_attn.forward(x, cos_sin, meta)
        x, residual = self.post_attention_layernorm.forward(x, residual)
        return self.mlp.forward(x), residual

    def emit_step(self, b, x, residual):
        """`forward` as a step program's calls (fw.layers.replay)."""
        replays(self, PreNormDecoderLayer)
        if residual is None:
            residual = x
            x = emit(self.input_layernorm, b, x)
        else:
            x, residual = emit(self.input_layernorm, b, x, residual)
        x = emit(self.self_attn, b, x)
        x, residual = emit(self.post_attention_layernorm, b, x, residual)
        return emit(self.mlp, b, x), residual


class PostNormDecoderLayer(nn.Module):
    """attention, then MLP, each followed by its RMSNorm before the residual add (OLMo 2):
    x + norm(attn(x)), then x + norm(mlp(x)). The residual stream is the layer's output itself, so
    it returns (hidden, None). Subclasses build `self_attn`, `post_attention_layernorm`, `mlp` and
    `post_feedforward_layernorm`."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos_sin, meta):
        if residual is not None:  # after a pre-norm layer: fold its carried residual in
            x = x + residual
        x = x + self.post_attention_layernorm.forward(self.self_attn.forward(x, cos_sin, meta))
        return x + self.post_feedforward_layernorm.forward(self.mlp.forward(x)), None


class DecoderModel(nn.Module):
    """embed_tokens -> decoder layers (one rotary cos/sin per step, shared by all) -> final RMSNorm.

    Each layer follows the protocol in this module's docstring. `norm`: the final norm, when the
    family's differs from a Llama RMSNorm (say, another `rounding`)."""

    def __init__(self, cfg, ctx: ModelContext, max_positions: int, layers, head_dim: int | None = None,
                 norm: nn.Module | None = None):
        super().__init__()
        cfg = as_model_config(cfg).require("norm_eps")  # a transformers config from a pre-1.5 plugin
        # an empty weight the checkpoint fills: nn.Embedding's own random init is start-up time for nothing
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _freeze=True,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=ctx.dtype))
        head_dim = head_dim or cfg.head_dim
        self.rotary = RotaryEmbedding(cfg, head_dim, max_positions, ctx.dtype)
        self.layers = nn.ModuleList(layers)
        self.norm = norm if norm is not None else RMSNorm(cfg.hidden_size, cfg.norm_eps, ctx.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        cos_sin = self.rotary(positions)
        replayed = replay.for_step(self, x, meta)  # the layers' calls from C++, on CPU (fw.layers.replay)
        if replayed is not None:
            x, residual = replayed.run(x, cos_sin, meta)
        else:
            for layer in self.layers:
                x, residual = layer.forward(x, residual, cos_sin, meta)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]
