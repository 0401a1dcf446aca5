"""The shared MoE layer (fw.layers.moe) and the `moe_kernel` plugin kind: routing against a dense
reference, whole blocks against transformers' own MoE blocks (fp32 and bf16, bit for bit),
the grouped kernel's matmul count, kernel selection by flag and priority with clear errors."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode
from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

import plugin_fixtures as pf
import tiny_moe
from conftest import make_llm
from fw import SamplingParams
from fw.errors import ConfigError, UnknownImplementationError, UnsupportedConfigurationError
from fw.layers import (FUSED_PROJECTIONS, GATED_EXPERT_NAMES, FusedExperts, ModelContext, SparseMoeBlock,
                       load_moe_weights, topk_routing)
from fw.plugins import MoeKernelSpec, MoeRequirements
from fw.plugins.manager import get_plugin_manager
from fw.plugins.registry import Registry
from fw.plugins.selection import MoeKernelChooser, select_moe_kernel

H, I, E, K = 64, 32, 8, 2


# -- routing -------------------------------------------------------------------------------------


def dense_routing(logits: torch.Tensor, top_k: int, renormalize: bool) -> torch.Tensor:
    """[T, E] weights with zeros for unchosen experts, one token at a time, from the definition."""
    out = torch.zeros(logits.shape, dtype=torch.float64)
    for t, row in enumerate(logits.double()):
        probs = torch.exp(row - row.max())
        probs = probs / probs.sum()
        chosen = sorted(range(len(row)), key=lambda e: -probs[e].item())[:top_k]
        total = sum(probs[e] for e in chosen) if renormalize else 1.0
        for e in chosen:
            out[t, e] = probs[e] / total
    return out


@pytest.mark.parametrize("renormalize", [True, False])
def test_routing_matches_a_dense_reference(renormalize):
    torch.manual_seed(0)
    logits = torch.randn(40, E) * 2
    weights, ids = topk_routing(logits, K, renormalize, weights_in_model_dtype=False)
    assert weights.dtype == torch.float32 and ids.shape == (40, K)
    got = torch.zeros(40, E, dtype=torch.float64).scatter_(1, ids, weights.double())
    assert torch.allclose(got, dense_routing(logits, K, renormalize), atol=1e-6)
    assert torch.allclose(weights.sum(-1), torch.ones(40)) == renormalize
    if renormalize:  # Mixtral's original formulation: a softmax over the top-k logits
        assert torch.allclose(weights, torch.softmax(torch.gather(logits, 1, ids), dim=-1), atol=1e-6)


def test_routing_weight_dtype_follows_the_family():
    """Mixtral keeps float32 weights for bf16 activations; Qwen-MoE casts them to the model dtype.
    Either way the softmax runs in float32, so the choice of experts is the fp32 one."""
    torch.manual_seed(1)
    logits = (torch.randn(16, E) * 2).bfloat16()
    mixtral_w, mixtral_ids = topk_routing(logits, K, True, weights_in_model_dtype=False)
    qwen_w, qwen_ids = topk_routing(logits, K, True, weights_in_model_dtype=True)
    assert mixtral_w.dtype == torch.float32 and qwen_w.dtype == torch.bfloat16
    assert torch.equal(mixtral_ids, qwen_ids) and torch.equal(mixtral_w.bfloat16(), qwen_w)
    ref = torch.topk(torch.softmax(logits.float(), -1), K)
    assert torch.equal(mixtral_ids, ref.indices)


# -- whole blocks against transformers -------------------------------------------------------------


def moe_context(dtype: torch.dtype, registry=None, name: str | None = None) -> ModelContext:
    chooser = MoeKernelChooser(registry or get_plugin_manager().registry("moe_kernel"), name)
    return ModelContext(dtype=dtype, device=torch.device("cpu"), attention_backend=None,
                        extra={"moe_kernel": chooser})


HF_BLOCKS = {
    "mixtral": (MixtralSparseMoeBlock,
                lambda: MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K),
                dict(renormalize=True, weights_in_model_dtype=False)),
    "qwen2_moe": (Qwen2MoeSparseMoeBlock,
                  lambda: Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=I, shared_expert_intermediate_size=48,
                                         num_experts=E, num_experts_per_tok=K, norm_topk_prob=False),
                  dict(renormalize=False, weights_in_model_dtype=True, shared_expert_intermediate_size=48,
                       shared_expert_gate=True)),
    "qwen3_moe": (Qwen3MoeSparseMoeBlock,
                  lambda: Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K,
                                         norm_topk_prob=True),
                  dict(renormalize=True, weights_in_model_dtype=True)),
}


def hf_and_fw_blocks(family: str, dtype: torch.dtype, **ctx_options):
    cls, make_config, options = HF_BLOCKS[family]
    config = make_config()
    config._experts_implementation = "eager"  # the per-expert loop as written in the modelling code
    torch.manual_seed(0)
    hf = cls(config)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
    hf = hf.to(dtype)
    block = SparseMoeBlock(H, I, E, K, moe_context(dtype, **ctx_options), "mlp", **options)
    # transformers' in-memory names: the stacked `experts.gate_up_proj` / `experts.down_proj`
    loaded = load_moe_weights(block, hf.state_dict().items(), GATED_EXPERT_NAMES, fused=FUSED_PROJECTIONS)
    assert loaded == {name for name, _ in block.named_parameters()}
    return hf, block


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", list(HF_BLOCKS))
def test_block_matches_transformers_block(family, dtype):
    """The same numbers as transformers' block (bf16: bit for bit, so routing-weight dtypes and the
    order of the weighted sum are transformers'); fp32 up to the rounding of packed CPU weights."""
    hf, block = hf_and_fw_blocks(family, dtype)
    torch.manual_seed(2)
    x = torch.randn(1, 50, H).to(dtype)
    with torch.no_grad():
        ref, got = hf(x)[0], block(x[0])
    assert got.dtype == dtype
    if dtype == torch.bfloat16:
        assert torch.equal(got, ref)
    else:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


class MatmulCounter(TorchFunctionMode):
    """Counts the matrix products torch runs inside the mode."""

    NAMES = {"linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "einsum", "__matmul__", "_grouped_mm"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.NAMES:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_grouped_kernel_loops_over_experts_not_tokens():
    """At most one gate/up and one down matmul per expert, whatever the number of tokens."""
    _, block = hf_and_fw_blocks("qwen3_moe", torch.float32)
    counts = {}
    for tokens in (64, 512):
        x = torch.randn(tokens, H)
        weights, ids = block.gate(x)
        assert len(ids.unique()) == E  # every expert active, so the count is the most it can be
        with torch.no_grad(), MatmulCounter() as counter:
            out = block.experts(x, weights, ids)
        assert out.shape == (tokens, H)
        counts[tokens] = counter.count
    assert counts[64] == counts[512] <= 2 * E, counts
    # a single token touches only its top-k experts
    x = torch.randn(1, H)
    weights, ids = block.gate(x)
    with torch.no_grad(), MatmulCounter() as counter:
        block.experts(x, weights, ids)
    assert counter.count <= 2 * K


def test_experts_need_a_kernel():
    ctx = ModelContext(dtype=torch.float32, device=torch.device("cpu"), attention_backend=None)
    with pytest.raises(ConfigError, match="no MoE kernel.*MoeKernelChooser"):
        FusedExperts(E, H, I, K, ctx, "model.layers.0.mlp.experts")


# -- the moe_kernel plugin kind --------------------------------------------------------------------


class DenseKernel:
    """A kernel of another plugin: every expert on every token, masked by the routing weights."""

    calls = 0

    def process_weights_after_loading(self, experts):
        pass

    def forward(self, experts, x, topk_weights, topk_ids):
        type(self).calls += 1
        dense = torch.zeros(x.shape[0], experts.num_experts, dtype=topk_weights.dtype)
        dense.scatter_(1, topk_ids, topk_weights)
        out = torch.zeros_like(x)
        for e in range(experts.num_experts):
            gate, up = torch.nn.functional.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)
            y = torch.nn.functional.linear(experts.act_fn(gate) * up, experts.down_proj[e])
            out += (y * dense[:, e:e + 1]).to(x.dtype)
        return out


REQ = MoeRequirements(device="cpu", dtype="float32", num_experts=E, top_k=K, hidden_size=H, intermediate_size=I,
                      activation="silu")


def registry(*specs: MoeKernelSpec) -> Registry:
    reg = Registry("moe_kernel")
    for spec in specs:
        reg.add(spec, "tests", "tests")
    return reg


def test_selection_by_priority_name_and_capabilities():
    reg = registry(MoeKernelSpec("grouped", DenseKernel),
                   MoeKernelSpec("fast", DenseKernel, priority=10),
                   MoeKernelSpec("gpu_only", DenseKernel, devices=("cuda",), priority=100),
                   MoeKernelSpec("gelu_only", DenseKernel, activations=("gelu_pytorch_tanh",), priority=50))
    auto = select_moe_kernel(reg, REQ)
    assert auto.chosen.name == "fast" and not auto.explicit
    assert set(auto.rejected) == {"gpu_only", "gelu_only"}
    assert "activation 'silu' not supported" in auto.rejected["gelu_only"][0]
    assert select_moe_kernel(reg, REQ, "grouped").chosen.name == "grouped"
    with pytest.raises(UnsupportedConfigurationError,
                       match=r"MoE kernel 'gpu_only' cannot run.*device 'cpu' not supported.*--moe-backend with "
                             r"one that would work: fast, grouped \(or auto\)"):
        select_moe_kernel(reg, REQ, "gpu_only")
    with pytest.raises(UnsupportedConfigurationError, match="no MoE kernel can run.*gpu_only: device"):
        select_moe_kernel(registry(MoeKernelSpec("gpu_only", DenseKernel, devices=("cuda",))), REQ)
    with pytest.raises(UnknownImplementationError,
                       match=r"--moe-backend nope: no MoE kernel of that name; choose auto or one of: fast, "
                             r"gelu_only, gpu_only, grouped"):
        MoeKernelChooser(reg, "nope")


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory, tokenizer):
    return tiny_moe.build_model(tiny_moe.MIXTRAL, tokenizer, tmp_path_factory.mktemp("moe_kernel") / "mixtral")


def test_a_plugin_kernel_is_selected_by_flag_and_priority(root, mixtral_dir):
    """A third-party distribution adds a moe_kernel; `moe_backend=NAME` picks it (or the built-in),
    auto picks it by priority, and both give the built-in's tokens."""
    module = pf.unique("fwtest_moe_kernel")
    source = pf.plugin_source("""
        @hookimpl
        def fw_register_moe_kernels(register):
            register(MoeKernelSpec("dense_ref", DenseKernel, priority=5, description="test"))
            register(MoeKernelSpec("gpu_fused", DenseKernel, devices=("cuda",), priority=100))
        """, imports="from fw.plugins import MoeKernelSpec\nfrom test_moe_layer import DenseKernel\n")
    manager = pf.builtin_manager(pf.make_distribution(root, "fw-moe-kernel", {module: source}, {"moekern": module}))
    assert manager.plugins["moekern"].provides == {"moe_kernel": ["dense_ref", "gpu_fused"]}
    assert manager.plugins["moe_grouped"].provides == {"moe_kernel": ["grouped"]}

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = ["Hello world", "a b c"]
    DenseKernel.calls = 0
    grouped = make_llm(mixtral_dir, plugins=manager, moe_backend="grouped", num_kv_blocks=16)
    expected = [o.outputs[0].token_ids for o in grouped.generate(prompts, params)]
    assert DenseKernel.calls == 0
    for options in ({"moe_backend": "dense_ref"}, {}):  # by name, then by priority (auto)
        llm = make_llm(mixtral_dir, plugins=manager, num_kv_blocks=16, **options)
        experts = [m for m in llm.engine.runner.model.modules() if isinstance(m, FusedExperts)]
        assert experts and all(isinstance(m.kernel, DenseKernel) for m in experts)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert DenseKernel.calls > 0

    with pytest.raises(UnsupportedConfigurationError, match=r"'gpu_fused' cannot run.*would work: dense_ref, grouped"):
        make_llm(mixtral_dir, plugins=manager, moe_backend="gpu_fused", num_kv_blocks=16)
    with pytest.raises(UnknownImplementationError, match="choose auto or one of: dense_ref, gpu_fused, grouped"):
        make_llm(mixtral_dir, plugins=manager, moe_backend="nope", num_kv_blocks=16)


def test_moe_backend_flag_environment_and_listing(mixtral_dir, capsys, monkeypatch, isolated_plugins):
    import json

    from fw.cli.main import main
    from fw.config import resolve_config

    assert resolve_config(environ={}).moe_backend == "auto"
    assert resolve_config(environ={"FW_MOE_BACKEND": "grouped"}).moe_backend == "grouped"
    assert resolve_config(cli={"moe_backend": "x"}, environ={"FW_MOE_BACKEND": "grouped"}).moe_backend == "x"

    assert main(["plugins", "list", "--json", "--kind", "moe_kernel"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["plugins"]}
    assert rows["moe_grouped"]["provides"] == {"moe_kernel": ["grouped"]}
    assert "mixtral" not in rows

    code = main(["generate", "--model", str(mixtral_dir), "--prompt", "hi", "--moe-backend", "nonexistent",
                 "--num-kv-blocks", "16", "--dtype", "float32"])
    assert code == 2
    assert "--moe-backend nonexistent: no MoE kernel of that name; choose auto or one of: grouped" in \
        capsys.readouterr().err
