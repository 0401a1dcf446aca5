"""The MoE-kernel suite: the kernel against a plain per-expert loop over tokens, in fp32.

The kernel gets a real `fw.layers.FusedExperts` layer (random stacked weights, its
`process_weights_after_loading` called as after a checkpoint load) and routing from
`fw.layers.moe.topk_routing`, for several token counts (one token, a few, more tokens than
experts), top-1 and top-2, routing weights in float32 (Mixtral) and in the model dtype
(Qwen-MoE), over the dtypes and activations the spec declares."""

from __future__ import annotations

from typing import Any

import torch

from fw.devices import cuda_capability
from fw.layers import FusedExperts, ModelContext
from fw.layers.moe import topk_routing
from fw.plugins import MoeRequirements
from fw.testing.suite import Case, SuiteTest, device_for, stable_seed, worst_difference

OPTIONS = frozenset({"dtypes"})

TOLERANCES = {"float32": (1e-4, 1e-4), "bfloat16": (3e-2, 3e-2), "float16": (5e-3, 5e-3)}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
NUM_EXPERTS, HIDDEN, INTERMEDIATE = 6, 32, 24


def reference_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor, act) -> torch.Tensor:
    """sum_j weights[t, j] * down_e(act(gate_e(x_t)) * up_e(x_t)), e = ids[t, j]: one token, one expert
    at a time, in fp32. gate_up [E, 2I, H] (gate rows first), down [E, H, I]."""
    inter = down.shape[-1]
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = gate_up[e].float() @ x[t].float()
            y = down[e].float() @ (act(h[:inter]) * h[inter:])
            out[t] += float(weights[t, j]) * y
    return out


def tests(spec: Any, options: dict) -> list[SuiteTest]:
    device = device_for(spec, options)
    dtypes = [d for d in options.get("dtypes") or spec.dtypes if d in _DTYPES]
    activations = list(spec.activations) if spec.activations is not None else ["silu", "gelu_pytorch_tanh"]
    cases = []
    for dtype in dtypes:
        for tokens, top_k in ((1, 2), (5, 1), (17, 2)):
            cases.append(dict(tokens=tokens, top_k=top_k, dtype=dtype, act=activations[0], routing="fp32"))
        if dtype != "float32":
            cases.append(dict(tokens=9, top_k=2, dtype=dtype, act=activations[0], routing="model"))
    cases += [dict(tokens=9, top_k=2, dtype=dtypes[0], act=a, routing="fp32") for a in activations[1:]]
    built = []
    for c in cases:
        case_id = f"tokens{c['tokens']}-top{c['top_k']}-{c['act']}-{_SHORT[c['dtype']]}-weights_{c['routing']}"
        req = MoeRequirements(device=device, dtype=c["dtype"], num_experts=NUM_EXPERTS, top_k=c["top_k"],
                              hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, activation=c["act"],
                              capability=cuda_capability(device))
        built.append(Case(case_id, c, "; ".join(spec.rejection_reasons(req)) or None))
    return [SuiteTest("test_matches_reference", lambda case: run_case(spec, case, device), built,
                      "The kernel's output equals a per-token, per-expert loop within the dtype's tolerance.")]


def run_case(spec: Any, case: Case, device: str) -> None:
    c = case.data
    dtype = _DTYPES[c["dtype"]]
    dev = torch.device(device)
    ctx = ModelContext(dtype, dev, attention_backend=None, extra={"moe_kernel": lambda req: spec.kernel_cls()})
    experts = FusedExperts(NUM_EXPERTS, HIDDEN, INTERMEDIATE, c["top_k"], ctx, "model.layers.0.mlp.experts",
                           hidden_act=c["act"])
    gen = torch.Generator().manual_seed(stable_seed(case.id))
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=gen) * HIDDEN ** -0.5)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=gen) * INTERMEDIATE ** -0.5)
    gate_up, down = experts.gate_up_proj.detach().clone(), experts.down_proj.detach().clone()
    experts.to(dev)
    experts.kernel.process_weights_after_loading(experts)
    x = torch.randn(c["tokens"], HIDDEN, generator=gen).to(dtype)
    router_logits = (torch.randn(c["tokens"], NUM_EXPERTS, generator=gen) * 2).to(dtype)
    weights, ids = topk_routing(router_logits, c["top_k"], renormalize=True,
                                weights_in_model_dtype=c["routing"] == "model")
    with torch.inference_mode():
        out = experts(x.to(dev), weights.to(dev), ids.to(dev))
    if tuple(out.shape) != tuple(x.shape) or out.dtype != dtype:
        raise AssertionError(f"{case.id}: returned {out.dtype} {tuple(out.shape)}, expected {dtype} {tuple(x.shape)}")
    want = reference_experts(x, gate_up, down, weights, ids, experts.act_fn)
    atol, rtol = TOLERANCES[c["dtype"]]
    worst, flat, ok = worst_difference(out.float().cpu(), want, atol, rtol)
    if not ok:
        raise AssertionError(f"{case.id}: worst |kernel - reference| = {worst:.4g} at token {flat // HIDDEN}, "
                             f"channel {flat % HIDDEN} (experts {ids[flat // HIDDEN].tolist()}; tolerance "
                             f"{atol:g} + {rtol:g}*|ref|)")
