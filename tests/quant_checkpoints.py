"""Tiny packed-integer checkpoints (GPTQ, AWQ) written by the tests themselves, and the
checks every such format must pass.

The packing and unpacking here follow the published formats with their own plain
Python/NumPy loops, so they share no code with fw's plugins:

- GPTQ (AutoGPTQ/GPTQModel): `qweight` int32 [in / pack, out], value j of a word in bits
  [j*bits, (j+1)*bits); `qzeros` int32 [groups, out / pack] packed the same way along the
  output; `scales` fp16 [groups, out]; `g_idx` int32 [in]. v1 checkpoints store zero - 1.
- AWQ GEMM (AutoAWQ): `qweight` int32 [in, out / 8] and `qzeros` int32 [groups, out / 8] packed
  along the output, int32 column c holding columns c*8 + [0, 2, 4, 6, 1, 3, 5, 7] in nibbles 0..7.

Checks: (a) every quantized fw linear's output equals x @ W_deq^T for the test's own
dequantized weights; (b) greedy generation (fp32, 16 tokens, prompts in one batch) equals
transformers' Llama with those weights loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from tiny_models import VOCAB_SIZE

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
PROMPTS = ["Hello world", "The engine schedules every request in pages of keys and values.",
           "Once upon a time, in a small village by the river"]
NEW_TOKENS = 16


def float_llama(tokenizer, seed: int = 7):
    """A random fp32 Llama with untied LM head (so the float head next to quantized layers is covered)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():  # wide weights: varied greedy text with peaked distributions (see tiny_models)
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.1 if "embed" in name or "lm_head" in name else 0.3)
        model.model.norm.weight.fill_(4.0)
    return model.eval()


# ---- integer quantization of one weight (the values a GPTQ/AWQ run would produce) ----

def quantize(w: torch.Tensor, bits: int, g_idx: np.ndarray, groups: int, sym: bool, min_zero: int = 0):
    """W [out, in] -> (q [in, out], zeros [groups, out], scales fp16 [groups, out]) of min-max
    quantization per (group, output); `min_zero` keeps zeros >= 1 where a v1 GPTQ checkpoint
    could not store zero 0 (it stores zero - 1 in `bits` bits)."""
    maxq = 2 ** bits - 1
    wt = w.t().double().numpy()  # [in, out]
    q = np.zeros(wt.shape, dtype=np.int64)
    zeros = np.zeros((groups, wt.shape[1]), dtype=np.int64)
    scales = np.zeros((groups, wt.shape[1]), dtype=np.float16)
    for g in range(groups):
        rows = np.nonzero(g_idx == g)[0]
        block = wt[rows]
        lo, hi = np.minimum(block.min(0), 0), np.maximum(block.max(0), 0)
        if sym:
            hi = np.maximum(np.abs(lo), hi)
            lo = -hi
        scale = ((hi - lo) / maxq).astype(np.float16)
        scale[scale == 0] = 1
        zero = np.full(wt.shape[1], (maxq + 1) // 2) if sym else np.clip(np.round(-lo / scale), min_zero, maxq)
        q[rows] = np.clip(np.round(block / scale.astype(np.float64)) + zero, 0, maxq)
        zeros[g], scales[g] = zero, scale
    return q, zeros, scales


# ---- packing and unpacking, element by element ----

def _to_int32(words: np.ndarray) -> np.ndarray:
    return (words & 0xFFFFFFFF).astype(np.uint32).view(np.int32)


def pack_rows(values: np.ndarray, bits: int) -> np.ndarray:
    """[R, C] -> int32 [R * bits / 32, C]: rows r*pack .. r*pack+pack-1 in one word, first lowest."""
    pack = 32 // bits
    out = np.zeros((values.shape[0] // pack, values.shape[1]), dtype=np.int64)
    for r in range(out.shape[0]):
        for j in range(pack):
            out[r] |= (values[r * pack + j].astype(np.int64) & (2 ** bits - 1)) << (bits * j)
    return _to_int32(out)


def pack_columns(values: np.ndarray, bits: int, order: tuple[int, ...] | None = None) -> np.ndarray:
    """[R, C] -> int32 [R, C * bits / 32]; slot j of word c holds column c*pack + order[j]."""
    pack = 32 // bits
    order = order or tuple(range(pack))
    out = np.zeros((values.shape[0], values.shape[1] // pack), dtype=np.int64)
    for c in range(out.shape[1]):
        for j in range(pack):
            out[:, c] |= (values[:, c * pack + order[j]].astype(np.int64) & (2 ** bits - 1)) << (bits * j)
    return _to_int32(out)


def unpack_rows(words: np.ndarray, bits: int) -> np.ndarray:
    pack, w = 32 // bits, words.view(np.uint32).astype(np.int64)
    out = np.zeros((w.shape[0] * pack, w.shape[1]), dtype=np.int64)
    for r in range(w.shape[0]):
        for j in range(pack):
            out[r * pack + j] = (w[r] >> (bits * j)) & (2 ** bits - 1)
    return out


def unpack_columns(words: np.ndarray, bits: int, order: tuple[int, ...] | None = None) -> np.ndarray:
    pack, w = 32 // bits, words.view(np.uint32).astype(np.int64)
    order = order or tuple(range(pack))
    out = np.zeros((w.shape[0], w.shape[1] * pack), dtype=np.int64)
    for c in range(w.shape[1]):
        for j in range(pack):
            out[:, c * pack + order[j]] = (w[:, c] >> (bits * j)) & (2 ** bits - 1)
    return out


# ---- checkpoints ----

def save_checkpoint(path: Path, model, tokenizer, tensors: dict[str, torch.Tensor], quant_config: dict) -> Path:
    """Float tensors of `model` that are not quantized, plus `tensors`, as model.safetensors +
    config.json with `quantization_config` + the tokenizer."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    quantized = {name.rsplit(".", 1)[0] for name in tensors}
    state = {n: t.contiguous() for n, t in model.state_dict().items()
             if n.rsplit(".", 1)[0] not in quantized and "rotary" not in n
             and not (n == "lm_head.weight" and model.config.tie_word_embeddings)}
    save_file({**state, **{n: t.contiguous() for n, t in tensors.items()}}, str(path / "model.safetensors"))
    config = model.config.to_dict()
    config["quantization_config"] = quant_config
    (path / "config.json").write_text(json.dumps(config))
    tokenizer.save_pretrained(path)
    return path


def dequantized_model(model, weights: dict[str, torch.Tensor]):
    """A copy of `model` (transformers) whose projections hold the test's dequantized weights."""
    import copy

    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, w in weights.items():
            ref.get_parameter(name + ".weight").copy_(w)
    ref.generation_config.eos_token_id = None
    return ref.eval()


# ---- the checks ----

def fused_reference(weights: dict[str, torch.Tensor], fw_prefix: str) -> torch.Tensor:
    """The dequantized [out, in] matrix a fused fw layer should compute with."""
    if fw_prefix.endswith("qkv_proj"):
        base = fw_prefix[: -len("qkv_proj")]
        return torch.cat([weights[base + p] for p in ("q_proj", "k_proj", "v_proj")])
    if fw_prefix.endswith("gate_up_proj"):
        base = fw_prefix[: -len("gate_up_proj")]
        return torch.cat([weights[base + p] for p in ("gate_proj", "up_proj")])
    return weights[fw_prefix]


def check_linear_outputs(llm, weights: dict[str, torch.Tensor], method_cls, device: str = "cpu") -> int:
    """(a): each quantized fw Linear's output against x @ W_deq^T; returns the layers checked.
    `device`: where the engine runs (the inputs go there; the reference stays in float64 on the CPU)."""
    from fw.layers import Linear

    model = llm.engine.loaded.model
    checked = 0
    torch.manual_seed(0)
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        if name == "lm_head" and name not in weights:
            assert not isinstance(module.method, method_cls), "the LM head must stay in float"
            continue
        assert isinstance(module.method, method_cls), name
        w = fused_reference(weights, name)
        for rows in (5, 40):  # decode-sized (grouped matmul on the codes) and prefill-sized (dequantized)
            x = torch.randn(rows, module.input_size)
            with torch.no_grad():
                got = module(x.to(device)).cpu()
            want = x.double() @ w.double().t()
            assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-4 * float(want.abs().max())), (name, rows)
        checked += 1
    return checked


def check_generation(llm, hf, tokenizer) -> None:
    """(b): fw's greedy tokens (all prompts in one batch) equal transformers' on the dequantized
    weights, and per-token logprobs agree within 1e-3."""
    from transformers import GenerationConfig

    from fw import SamplingParams

    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1))
    config = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0,
                              output_logits=True, return_dict_in_generate=True)
    for out, prompt in zip(outs, PROMPTS):
        ids = tokenizer(prompt).input_ids
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), generation_config=config, attention_mask=torch.ones(1, len(ids)))
        tokens = ref.sequences[0, len(ids):].tolist()
        got = out.outputs[0]
        assert got.token_ids == tokens, prompt
        for step, (entry, token) in enumerate(zip(got.logprobs, tokens)):
            want = torch.log_softmax(ref.logits[step][0].float(), dim=-1)[token].item()
            assert abs(entry[token].logprob - want) < 1e-3, (prompt, step)


def dense_bytes(llm) -> tuple[int, int]:
    """(bytes the quantized linears hold, bytes the same layers would hold in fp16)."""
    from fw.layers import Linear

    held = dense = 0
    for name, module in llm.engine.loaded.model.named_modules():
        if isinstance(module, Linear) and name != "lm_head":
            held += module.method.weight_bytes(module)
            dense += module.input_size * module.output_size * 2
    return held, dense
