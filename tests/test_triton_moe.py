"""The `triton` MoE kernel plugin.

On CPU its Triton kernels run under the interpreter (TRITON_INTERPRET=1) in a subprocess, so the
variable is set before triton is imported and no other test's triton import is affected: fp32,
small shapes (top-k 1, 2 and 3, token counts off the tile size, experts with no tokens, dimensions
off the block sizes, every supported activation, a strided input), each against the `grouped`
reference kernel. The interpreter's bf16 matrix products are wrong (numpy has no bf16), so bf16 and
fp16 are checked on the GPU only (`-m gpu`: larger shapes, and greedy generation on tiny Mixtral and
Qwen2-MoE models against `grouped`). The spec and its selection are checked in-process."""

from __future__ import annotations

import copy

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# (name, tokens, experts, top_k, hidden, inter, activation, tile (M, N, K, group) or None for the
#  default, the expert no token picks or None)
CASES = [
    ("topk1-5tokens-tile16", 5, 4, 1, 32, 24, "silu", (16, 16, 16, 1), 2),
    ("topk2-37tokens-ragged-dims", 37, 5, 2, 48, 40, "silu", (16, 16, 16, 2), 3),
    ("topk2-70tokens-default-tiles", 70, 4, 2, 64, 32, "silu", None, 0),
    ("topk2-1token-decode", 1, 8, 2, 64, 48, "silu", None, None),
    ("topk3-33tokens-tile32", 33, 6, 3, 40, 56, "silu", (32, 32, 32, 4), 5),
    ("gelu-tanh", 19, 3, 2, 32, 40, "gelu_pytorch_tanh", (16, 16, 16, 1), None),
    ("gelu-exact", 19, 3, 2, 32, 40, "gelu", (16, 16, 16, 1), None),
]
TOL = 2e-5  # fp32: only the order of accumulation inside each product differs


def _routing(tokens: int, experts: int, top_k: int, unused: int | None, gen: torch.Generator):
    logits = torch.randn(tokens, experts, generator=gen) * 2
    if unused is not None:
        logits[:, unused] = -1e4
    weights, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


def _experts(experts: int, hidden: int, inter: int, activation: str, kernel, gen: torch.Generator):
    """A FusedExperts layer with random weights whose kernel is `kernel`."""
    from fw.layers import FusedExperts, ModelContext

    ctx = ModelContext(dtype=torch.float32, device=torch.device("cpu"), attention_backend=None,
                       extra={"moe_kernel": lambda req: kernel})
    layer = FusedExperts(experts, hidden, inter, 2, ctx, "mlp.experts", hidden_act=activation)
    layer.gate_up_proj.data.copy_(torch.randn(layer.gate_up_proj.shape, generator=gen) * 0.2)
    layer.down_proj.data.copy_(torch.randn(layer.down_proj.shape, generator=gen) * 0.2)
    kernel.process_weights_after_loading(layer)
    return layer


def interpreter_worker() -> None:
    """Runs in the subprocess with TRITON_INTERPRET=1; prints one JSON object of findings."""
    from fw.backends.moe.grouped import GroupedMoeKernel
    from fw.backends.moe.triton_moe import TritonMoeKernel
    from fw.backends.moe.triton_moe_kernels import TileConfig, align_block_size, fused_moe

    torch.set_num_threads(1)
    found: dict = {"cases": {}}
    for i, (name, tokens, experts, top_k, hidden, inter, act, tile, unused) in enumerate(CASES):
        gen = torch.Generator().manual_seed(100 + i)
        layer = _experts(experts, hidden, inter, act, GroupedMoeKernel(), gen)
        x = torch.randn(tokens, hidden, generator=gen)
        weights, ids = _routing(tokens, experts, top_k, unused, gen)
        want = layer(x, weights, ids)
        cfg = TileConfig(*tile) if tile else None
        got = fused_moe(x, layer.gate_up_proj, layer.down_proj, weights, ids, act, cfg)
        found["cases"][name] = {"err": (got - want).abs().max().item(), "scale": want.abs().max().item(),
                                "shape": list(got.shape), "dtype": str(got.dtype),
                                "experts_used": sorted(set(ids.flatten().tolist()))}

    # through the MoeKernel interface, with x a strided view and Mixtral's float32 weights
    gen = torch.Generator().manual_seed(7)
    reference = _experts(8, 64, 32, "silu", GroupedMoeKernel(), gen)
    layer = _experts(8, 64, 32, "silu", TritonMoeKernel(), torch.Generator().manual_seed(7))
    x = torch.randn(23, 128, generator=gen)[:, ::2]
    weights, ids = _routing(23, 8, 2, 1, gen)
    want, got = reference(x, weights, ids), layer(x, weights, ids)
    found["layer"] = {"err": (got - want).abs().max().item(), "scale": want.abs().max().item()}
    found["empty"] = list(layer(x[:0], weights[:0], ids[:0]).shape)

    # the alignment itself: every assignment once, each tile one expert, sentinel padding
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [1, 0], [3, 2]])
    sorted_ids, tile_expert, num_padded = align_block_size(ids, 5, 4)
    found["align"] = {"sorted_ids": sorted_ids.tolist(), "tile_expert": tile_expert.tolist(),
                      "num_padded": num_padded.tolist()}
    print(json.dumps(found))


@pytest.fixture(scope="module")
def interpreted() -> dict:
    """The worker's findings. Skips only when triton is not installed; any failure of the worker fails."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install triton): the interpreter tests need it")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    tests_dir = str(Path(__file__).parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [tests_dir, env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", "import test_triton_moe as t; t.interpreter_worker()"],
                          env=env, capture_output=True, text=True, timeout=300, cwd=tests_dir)
    assert proc.returncode == 0, f"interpreter worker failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_interpreted_kernel_matches_grouped(interpreted, case):
    name, tokens, experts, top_k, hidden, _, _, _, unused = case
    found = interpreted["cases"][name]
    assert found["shape"] == [tokens, hidden] and found["dtype"] == "torch.float32"
    assert found["scale"] > 0.1  # a real output, not zeros on both sides
    assert found["err"] <= TOL * max(1.0, found["scale"]), found
    if unused is not None:
        assert unused not in found["experts_used"]


def test_interpreted_layer_with_strided_input_and_no_tokens(interpreted):
    layer = interpreted["layer"]
    assert layer["scale"] > 0.1 and layer["err"] <= TOL * max(1.0, layer["scale"]), layer
    assert interpreted["empty"] == [0, 64]


def test_align_block_size_groups_assignments_by_expert(interpreted):
    """ids [[3,0],[3,1],[0,3],[1,0],[3,2]]: assignment a = 2t + j; expert 0 has a = 1, 4, 7 (tile 0),
    expert 1 a = 3, 6 (tile 1), expert 2 a = 9 (tile 2), expert 3 a = 0, 2, 5, 8 (tile 3), expert 4 none;
    padding rows hold 10 (the number of assignments); tiles past the end have expert -1."""
    align = interpreted["align"]
    pad = 10
    assert align["num_padded"] == [16]
    assert align["sorted_ids"][:16] == [1, 4, 7, pad, 3, 6, pad, pad, 9, pad, pad, pad, 0, 2, 5, 8]
    assert all(v == pad for v in align["sorted_ids"][16:])
    assert align["tile_expert"][:4] == [0, 1, 2, 3] and all(e == -1 for e in align["tile_expert"][4:])


# -- the spec, in-process (no triton import) ----------------------------------------------------------


def _moe_registry():
    from fw.plugins.manager import get_plugin_manager

    return get_plugin_manager().registry("moe_kernel")


def test_spec_declares_cuda_and_ranks_below_grouped_until_tuned():
    """Measured slower than grouped on an H200 (docs/moe-kernels.md): auto keeps grouped on CUDA."""
    registry = _moe_registry()
    spec, grouped = registry.get("triton"), registry.get("grouped")
    assert spec.devices == ("cuda",) and spec.priority < grouped.priority
    assert {"bfloat16", "float16", "float32"} <= set(spec.dtypes)
    assert spec.activations is not None and "silu" in spec.activations and "gelu_pytorch_tanh" in spec.activations


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-side refusal")
def test_cpu_selection_picks_grouped_and_explains_triton():
    from fw.errors import UnsupportedConfigurationError
    from fw.plugins import MoeRequirements
    from fw.plugins.selection import select_moe_kernel

    req = MoeRequirements(device="cpu", dtype="bfloat16", num_experts=8, top_k=2, hidden_size=64,
                          intermediate_size=32, activation="silu")
    auto = select_moe_kernel(_moe_registry(), req)
    assert auto.chosen.name == "grouped"
    assert any("device 'cpu' not supported" in r for r in auto.rejected["triton"])
    assert any("no CUDA device" in r for r in auto.rejected["triton"])
    with pytest.raises(UnsupportedConfigurationError, match=r"MoE kernel 'triton' cannot run.*no CUDA device"):
        select_moe_kernel(_moe_registry(), req, "triton")


def test_unavailable_reason_names_a_missing_triton(monkeypatch):
    from fw.backends.moe import triton_moe

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    assert "triton package is not installed" in triton_moe.unavailable_reason()


# -- on a GPU ---------------------------------------------------------------------------------------------

GPU_SHAPES = [  # tokens, experts, top_k, hidden, inter
    (1, 8, 2, 1024, 2816),
    (7, 8, 2, 1024, 2816),
    (333, 60, 4, 2048, 1408),  # Qwen-MoE-like: many small experts
    (2048, 8, 2, 4096, 14336),  # Mixtral-8x7B layer, prefill-sized
]


def _gpu_case(tokens, experts, top_k, hidden, inter, dtype):
    from fw.backends.moe.grouped import GroupedMoeKernel
    from fw.backends.moe.triton_moe import TritonMoeKernel

    gen = torch.Generator().manual_seed(tokens)
    grouped = _experts(experts, hidden, inter, "silu", GroupedMoeKernel(), gen).to("cuda", dtype)
    x = torch.randn(tokens, hidden, generator=gen).to("cuda", dtype)
    weights, ids = _routing(tokens, experts, top_k, None, gen)
    weights, ids = weights.cuda(), ids.cuda()
    fused = TritonMoeKernel().forward(grouped, x, weights, ids)
    ref = GroupedMoeKernel().forward(grouped, x, weights, ids)
    up = grouped.to(torch.float32)
    exact = GroupedMoeKernel().forward(up, x.float(), weights, ids)
    return fused, ref, exact


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=[f"T{s[0]}-E{s[1]}-k{s[2]}" for s in GPU_SHAPES])
def test_gpu_kernel_matches_grouped(shape, dtype):
    """Same roundings as grouped, so the two differ only by accumulation order: neither is further
    from the fp32 result than about the other's error."""
    fused, ref, exact = _gpu_case(*shape, dtype)
    assert fused.dtype == dtype and fused.shape == ref.shape
    err_fused = (fused.float() - exact).abs().max().item()
    err_ref = (ref.float() - exact).abs().max().item()
    assert err_fused <= 2 * err_ref + 1e-3 * exact.abs().max().item(), (err_fused, err_ref)
    assert (fused.float() - ref.float()).abs().mean() <= 2 * (ref.float() - exact).abs().mean() + 1e-6


@pytest.mark.gpu
def test_gpu_kernel_fp32_is_ieee():
    """fp32 experts: IEEE products (no TF32), so the kernel is as close to a float64 result as the
    reference is (TF32 would be ~1e-3 off). Each side is measured against float64 on its own."""
    from fw.backends.moe.grouped import GroupedMoeKernel
    from fw.backends.moe.triton_moe import TritonMoeKernel

    gen = torch.Generator().manual_seed(64)
    experts = _experts(8, 1024, 512, "silu", GroupedMoeKernel(), gen).to("cuda", torch.float32)
    x = torch.randn(64, 1024, generator=gen).to("cuda")
    weights, ids = (t.cuda() for t in _routing(64, 8, 2, None, gen))
    exact = GroupedMoeKernel().forward(copy.deepcopy(experts).to(torch.float64), x.double(), weights.double(), ids)
    scale = exact.abs().max().item()
    errors = {name: (kernel.forward(experts, x, weights, ids).double() - exact).abs().max().item() / scale
              for name, kernel in (("triton", TritonMoeKernel()), ("grouped", GroupedMoeKernel()))}
    assert max(errors.values()) < 1e-5, (errors, torch.backends.cuda.matmul.allow_tf32)


PROMPTS = ["Hello world", "The engine schedules every request in pages of keys and values.", "a",
           "def add(a, b):\n    return a + b"]


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_gpu_greedy_generation_matches_grouped(family, tokenizer, tmp_path):
    """fp32 on CUDA: triton's greedy tokens and logprobs equal grouped's, and auto picks grouped."""
    import tiny_moe
    from conftest import make_llm
    from fw import SamplingParams
    from fw.backends.moe.grouped import GroupedMoeKernel
    from fw.backends.moe.triton_moe import TritonMoeKernel
    from fw.layers import FusedExperts

    spec = {s.name: s for s in tiny_moe.SPECS}[family]
    path = tiny_moe.build_model(spec, tokenizer, tmp_path / family)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    runs = {}
    for backend in ("triton", "auto"):
        llm = make_llm(path, device="cuda", moe_backend=backend, kv_cache_page_size=16)
        kernels = {type(m.kernel) for m in llm.engine.runner.model.modules() if isinstance(m, FusedExperts)}
        assert kernels == ({TritonMoeKernel} if backend == "triton" else {GroupedMoeKernel})
        runs[backend] = llm.generate(PROMPTS, params)
    for fused, ref in zip(runs["triton"], runs["auto"]):
        assert fused.outputs[0].token_ids == ref.outputs[0].token_ids, fused.prompt
        for a, b, token in zip(fused.outputs[0].logprobs, ref.outputs[0].logprobs, ref.outputs[0].token_ids):
            assert abs(a[token].logprob - b[token].logprob) < 1e-3

