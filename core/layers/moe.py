"""Mixture-of-Experts: the router, the experts stacked per layer, and the sparse block the MoE
families share (Mixtral; Qwen2-MoE with its sigmoid-gated shared expert; Qwen3-MoE).

Routing follows transformers' modelling code step for step, because a different rounding can
flip a top-k choice: router logits in the model dtype, softmax in float32, top-k, optional
renormalisation of the top-k probabilities, then the weights either kept in float32 (Mixtral)
or cast back to the model dtype (Qwen-MoE).

How the experts turn (tokens, routing weights, expert ids) into the layer output is a
`MoeKernel`, chosen among `moe_kernel` plugins like an attention backend (`--moe-backend`), so
a fused GPU kernel can replace the built-in grouped loop without touching architectures.

Expert weights are stacked per layer in the layout transformers 5 keeps in memory:
`gate_up_proj` [E, 2I, H] (gate rows first) and `down_proj` [E, H, I]. `load_moe_weights` fills
them from either checkpoint naming: per-expert tensors (`experts.{e}.w1/w3/w2` in Mixtral,
`experts.{e}.gate_proj/up_proj/down_proj` in Qwen-MoE; what hub checkpoints and
`save_pretrained` write) or the stacked tensors themselves (`save_original_format=False`).

Tensor parallelism splits every expert the way `GatedMLP` is split (vLLM's choice for its fused MoE):
each rank holds intermediate_size / tp of every expert's gate and up rows and the matching input
columns of its down projection, the router is replicated (every rank routes the same tokens the same
way), and `SparseMoeBlock` sums the ranks' partial outputs, its shared expert's included, with one
all-reduce. A kernel sees a `FusedExperts` whose `intermediate_size` is its rank's and computes it as
it would a smaller model's.
"""

from __future__ import annotations

import re
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from fw.devices import cuda_capability
from fw.distributed.group import tensor_parallel_of
from fw.errors import ConfigError, ModelLoadError
from fw.layers.blocks import ACTIVATIONS, GatedMLP
from fw.layers.context import ModelContext
from fw.layers.parallel import split_evenly
from fw.layers.weights import load_named_weights
from fw.plugins.specs import MoeRequirements

# checkpoint projection name -> (stacked parameter, part): part 0/1 are the gate/up rows of
# `gate_up_proj`, None the whole expert matrix.
MIXTRAL_EXPERT_NAMES = {"w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", None)}
GATED_EXPERT_NAMES = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
                      "down_proj": ("down_proj", None)}

_PER_EXPERT = re.compile(r"^(?P<module>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")


def topk_routing(logits: torch.Tensor, top_k: int, renormalize: bool,
          weights_in_model_dtype: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k], expert ids [T, k]), as transformers computes them.

    `renormalize`: divide the top-k probabilities by their sum (Mixtral always; Qwen-MoE's
    `norm_topk_prob`), which equals a softmax over the top-k logits. `weights_in_model_dtype`:
    cast the float32 weights to the logits' dtype (Qwen-MoE) instead of keeping float32 (Mixtral)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if weights_in_model_dtype:
        weights = weights.to(logits.dtype)
    return weights, ids


class TopKRouter(nn.Module):
    """The router: a bias-free linear layer to one logit per expert, then `topk_routing`.

    Kept out of the quantization method's reach, as in vLLM: the router is tiny and its
    rounding decides which experts run."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, dtype: torch.dtype, *,
                 renormalize: bool, weights_in_model_dtype: bool):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"MoE top-k must be in 1..{num_experts} (the number of experts), got {top_k}")
        self.top_k, self.renormalize, self.weights_in_model_dtype = top_k, renormalize, weights_in_model_dtype
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return topk_routing(F.linear(x, self.weight), self.top_k, self.renormalize, self.weights_in_model_dtype)


class MoeKernel:
    """How a MoE layer computes its experts; `moe_kernel` plugins implement it (one instance per layer).

    `forward` receives the `FusedExperts` layer (its stacked `gate_up_proj` [E, 2I, H] and
    `down_proj` [E, H, I], `act_fn`, `num_experts`, `intermediate_size`), the tokens `x` [T, H],
    the routing weights [T, k] (float32 or x's dtype, as the family's router made them) and the
    expert ids [T, k] (int64). It returns [T, H] in x's dtype where row t is
    sum over j of (weights[t, j] * expert_{ids[t, j]}(x[t])).to(x.dtype), and
    expert_e(v) = down_e(act(gate_e(v)) * up_e(v)). transformers multiplies in the promoted dtype
    and casts each term before summing; kernels that must match it in bf16 do the same."""

    def process_weights_after_loading(self, experts: "FusedExperts") -> None:
        """Called once after the checkpoint is loaded: repack into the kernel's layout. Default: nothing."""

    def forward(self, experts: "FusedExperts", x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class FusedExperts(nn.Module):
    """One layer's experts, stacked, computed by the selected `MoeKernel`. With tensor parallelism
    `intermediate_size` is this rank's share of the model's (the stacked weights hold that share of
    every expert) and the output is this rank's partial sum; `SparseMoeBlock` reduces it."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, top_k: int, ctx: ModelContext,
                 prefix: str, *, hidden_act: str = "silu"):
        super().__init__()
        self.tp = tensor_parallel_of(ctx)
        intermediate_size = split_evenly(intermediate_size, self.tp.size, "intermediate features per expert", prefix)
        if hidden_act not in ACTIVATIONS:
            raise ValueError(f"MoE expert activation {hidden_act!r} is not supported "
                             f"(supported: {', '.join(ACTIVATIONS)})")
        self.prefix = prefix
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.activation, self.act_fn = hidden_act, ACTIVATIONS[hidden_act]
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size,
                                                     dtype=ctx.dtype), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, dtype=ctx.dtype),
                                      requires_grad=False)
        chooser = ctx.extra.get("moe_kernel")
        if chooser is None:
            raise ConfigError(
                f"{prefix}: no MoE kernel to compute the experts. Load MoE models through fw's loader "
                f"(fw.LLM or `fw generate`), which picks one from the moe_kernel plugins; when building "
                f"a model by hand, put fw.plugins.selection.MoeKernelChooser(registry) in "
                f"ModelContext.extra['moe_kernel']."
            )
        self.kernel: MoeKernel = chooser(MoeRequirements(
            device=ctx.device.type, dtype=str(ctx.dtype).removeprefix("torch."), num_experts=num_experts,
            top_k=top_k, hidden_size=hidden_size, intermediate_size=intermediate_size, activation=hidden_act,
            capability=cuda_capability(ctx.device)))
        # (expert, part) pairs loaded so far, to tell a complete checkpoint from a partial one
        self._loaded: dict[str, set] = {"gate_up_proj": set(), "down_proj": set()}

    def _parts(self, param_name: str) -> set:
        parts = (0, 1) if param_name == "gate_up_proj" else (None,)
        return {(e, p) for e in range(self.num_experts) for p in parts}

    def load_weight(self, param_name: str, tensor: torch.Tensor, shard: tuple[int, int | None] | None) -> None:
        """`shard` None: the stacked tensor of all experts; (expert, part): one expert's gate (0),
        up (1) or whole matrix (None)."""
        if param_name not in self._loaded:
            raise ModelLoadError(f"checkpoint tensor {self.prefix}.{param_name} has no matching parameter")
        param = getattr(self, param_name).data
        if shard is None:
            target, where, done = param, "", self._parts(param_name)
        else:
            expert, part = shard
            if not 0 <= expert < self.num_experts:
                raise ModelLoadError(f"checkpoint has expert {expert} for {self.prefix}, but the config says "
                                     f"{self.num_experts} experts (ids 0..{self.num_experts - 1})")
            target = param[expert]
            if part is not None:
                target = target.narrow(0, part * self.intermediate_size, self.intermediate_size)
            where, done = f"[expert {expert}{'' if part is None else ', ' + ('gate', 'up')[part]}]", {shard}
        target.copy_(self._rank_share(param_name, tensor, shard is None, where))
        self._loaded[param_name] |= done

    def _rank_share(self, param_name: str, tensor: torch.Tensor, stacked: bool, where: str) -> torch.Tensor:
        """This rank's share of a checkpoint tensor (its gate/up rows, its columns of down), once the
        tensor is found to have the whole model's shape: a narrowed view, copied by the caller."""
        local, ranks = self.intermediate_size, self.tp.size
        inter = local * ranks
        gate_up = param_name == "gate_up_proj"
        # per expert: gate or up [I, H], down [H, I]; stacked: gate_up [E, 2I, H], down [E, H, I]
        if gate_up:
            shape, dim = (2 * inter if stacked else inter, self.hidden_size), 0
        else:
            shape, dim = (self.hidden_size, inter), 1
        if stacked:
            shape, dim = (self.num_experts, *shape), dim + 1
        if tuple(tensor.shape) != shape:
            raise ModelLoadError(f"weight {self.prefix}.{param_name}{where}: checkpoint shape {tuple(tensor.shape)} "
                                 f"!= model shape {shape}")
        if ranks == 1:
            return tensor
        start = self.tp.rank * local
        if stacked and gate_up:  # the gate rows, then the up rows, of every expert
            return torch.cat([tensor.narrow(dim, start, local), tensor.narrow(dim, inter + start, local)], dim)
        return tensor.narrow(dim, start, local)

    def complete_params(self) -> list[str]:
        """Names of the stacked parameters every expert has been loaded into; a partly loaded one is an error."""
        complete = []
        for name, got in self._loaded.items():
            missing = self._parts(name) - got
            if not missing:
                complete.append(name)
            elif got:
                e, part = min(missing, key=lambda m: (m[0], -1 if m[1] is None else m[1]))
                what = "down" if part is None else ("gate", "up")[part]
                raise ModelLoadError(f"checkpoint lacks {len(missing)} expert tensors of {self.prefix}.{name}, "
                                     f"e.g. expert {e} ({what}); is the checkpoint complete?")
        return complete

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return self.kernel.forward(self, x, topk_weights, topk_ids)


class SparseMoeBlock(nn.Module):
    """Router + experts, plus an optional shared expert that every token runs (Qwen2-MoE), itself
    optionally scaled by sigmoid(shared_expert_gate(x)). Replaces the MLP of a decoder layer."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, ctx: ModelContext,
                 prefix: str, *, hidden_act: str = "silu", renormalize: bool, weights_in_model_dtype: bool,
                 shared_expert_intermediate_size: int | None = None, shared_expert_gate: bool = False):
        super().__init__()
        self.tp = tensor_parallel_of(ctx)
        self.gate = TopKRouter(hidden_size, num_experts, top_k, ctx.dtype, renormalize=renormalize,
                               weights_in_model_dtype=weights_in_model_dtype)
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size, top_k, ctx, f"{prefix}.experts",
                                    hidden_act=hidden_act)
        self.shared_expert = self.shared_expert_gate = None
        if shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, shared_expert_intermediate_size, ctx,
                                          f"{prefix}.shared_expert", hidden_act=hidden_act, reduce_results=False)
            if shared_expert_gate:
                self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False, dtype=ctx.dtype)
                self.shared_expert_gate.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared  # a per-token scale: linear in the sum
            out = out + shared
        return self.tp.all_reduce(out)  # the ranks' partial sums of experts and shared expert, at once


def load_moe_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    expert_names: dict[str, tuple[str, int | None]],
    *,
    fused: dict[str, tuple[str, int]] | None = None,
    skip: tuple[str, ...] = (),
    renames: tuple[tuple[str, str], ...] = (),
) -> set[str]:
    """`load_named_weights` for models with `FusedExperts`: per-expert checkpoint tensors
    (`<...>.experts.<e>.<proj>.weight`, `proj` a key of `expert_names`) go into their slice of the
    stacked weights; stacked tensors (`<...>.experts.gate_up_proj`) and everything else load as usual.
    `renames` are (old, new) substrings applied to every name first (Mixtral's
    `.block_sparse_moe.` -> `.mlp.`). Then each kernel's `process_weights_after_loading` runs.

    Returns the parameter names loaded; a stacked weight counts only once every expert is in it."""
    modules = dict(model.named_modules())

    def others() -> Iterable[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if any(s in name for s in skip):
                continue
            for old, new in renames:
                name = name.replace(old, new)
            m = _PER_EXPERT.match(name)
            experts = modules.get(m["module"]) if m else None
            if isinstance(experts, FusedExperts) and m["proj"] in expert_names:
                param, part = expert_names[m["proj"]]
                experts.load_weight(param, tensor, (int(m["expert"]), part))
                continue
            yield name, tensor

    loaded = load_named_weights(model, others(), fused=fused, skip=skip)
    for prefix, module in modules.items():
        if isinstance(module, FusedExperts):
            loaded.update(f"{prefix}.{name}" for name in module.complete_params())
            module.kernel.process_weights_after_loading(module)
    return loaded
