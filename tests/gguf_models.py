"""Tiny random Llamas written as .gguf files with the `gguf` library, for the gguf method's tests.

The reference weights are computed here, independently of fw: each linear's
packed bytes are dequantized with `gguf.quants.dequantize` (the library's numpy
port of ggml-quants.c) and q/k rows are put back into HF's order with this
module's own inverse of llama.cpp's permutation. `gguf.quants.quantize` has no
K-quant encoders, so K-quant tensors are random but valid blocks (random
quants and sub-block scales, with super-block scales set to finite float16
values that give weights of a useful size).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2  # input dims multiple of 256 (K-quants)
HEAD_DIM = HIDDEN // HEADS

_LINEARS = {  # HF sub-name -> GGUF sub-name
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
# K-quants: (byte offsets of float16 super-block scales, their magnitude)
_K_SCALES = {"Q4_K": ((0, 1.5e-3), (2, 1.5e-3)), "Q5_K": ((0, 8e-4), (2, 8e-4)), "Q6_K": ((208, 3e-4),)}


def hf_config(vocab_size: int, tokenizer, rope_theta: float = 10000.0, tied: bool = False):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=512,
        rope_theta=rope_theta, rms_norm_eps=1e-5, tie_word_embeddings=tied,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, architectures=["LlamaForCausalLM"],
    )


def to_llama_cpp(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's q/k permutation: HF rotate-half rows -> llama.cpp interleaved pairs."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def from_llama_cpp(w: np.ndarray, heads: int) -> np.ndarray:
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_blocks(qtype, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Valid random GGUF bytes [rows, bytes_per_row] of a K-quant type."""
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    for offset, scale in _K_SCALES[qtype.name]:
        d = (rng.uniform(0.5, 1.0, size=(data.shape[0], 1)) * scale).astype(np.float16)
        data[:, offset:offset + 2] = d.view(np.uint8)
    return data.reshape(rows, -1)


def pack(qtype, w: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Bytes of `w` in `qtype`: the library's quantizer where it has one, random valid blocks for K-quants."""
    from gguf import quants

    if qtype.name in _K_SCALES:
        return random_blocks(qtype, *w.shape, rng)
    return quants.quantize(w.astype(np.float32), qtype)


@dataclass
class GGUFCase:
    path: Path
    reference: dict[str, torch.Tensor]  # HF name -> independently dequantized float32 weight (HF row order)
    config: object


def write_tiny_llama_gguf(path: Path, qtype, tokenizer, seed: int = 0, permute_qk: bool = True,
                          overrides: dict | None = None, tied: bool = False) -> GGUFCase:
    """A random Llama whose linear weights (and untied LM head) are stored as `qtype`, except the HF
    sub-names in `overrides` (e.g. {"self_attn.v_proj": Q6_K}); norms and the embedding as F32.
    `permute_qk=False` stores q/k in HF's (neox) order. `tied`: no LM head of its own, and the embedding
    stored as `qtype` (as llama.cpp writes tied models: the head reads token_embd)."""
    overrides = overrides or {}
    import gguf

    rng = np.random.default_rng(seed)
    vocab = len(tokenizer)
    cfg = hf_config(vocab, tokenizer, tied=tied)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(512)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_embedding_length(HIDDEN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_vocab_size(vocab)
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)

    reference: dict[str, torch.Tensor] = {}

    def add_float(hf_name: str, gguf_name: str, w: np.ndarray) -> None:
        writer.add_tensor(gguf_name, w.astype(np.float32))
        reference[hf_name] = torch.from_numpy(w.astype(np.float32))

    def add_quant(hf_name: str, gguf_name: str, w: np.ndarray, t, heads: int | None) -> None:
        if heads is not None and permute_qk:
            w = to_llama_cpp(w, heads)
        data = pack(t, w, rng)
        writer.add_tensor(gguf_name, data, raw_dtype=t)
        deq = gguf.quants.dequantize(data, t).reshape(w.shape)
        if heads is not None and permute_qk:
            deq = from_llama_cpp(deq, heads)
        reference[hf_name] = torch.from_numpy(np.ascontiguousarray(deq, dtype=np.float32))

    embedding = rng.normal(0, 0.1, (vocab, HIDDEN))
    if tied:
        add_quant("model.embed_tokens.weight", "token_embd.weight", embedding, qtype, None)
    else:
        add_float("model.embed_tokens.weight", "token_embd.weight", embedding)
    for i in range(LAYERS):
        add_float(f"model.layers.{i}.input_layernorm.weight", f"blk.{i}.attn_norm.weight",
                  rng.uniform(0.8, 1.2, HIDDEN))
        add_float(f"model.layers.{i}.post_attention_layernorm.weight", f"blk.{i}.ffn_norm.weight",
                  rng.uniform(0.8, 1.2, HIDDEN))
        for hf_sub, gguf_sub in _LINEARS.items():
            out_dim = {"self_attn.q_proj": HIDDEN, "self_attn.k_proj": KV_HEADS * HEAD_DIM,
                       "self_attn.v_proj": KV_HEADS * HEAD_DIM, "self_attn.o_proj": HIDDEN,
                       "mlp.gate_proj": INTERMEDIATE, "mlp.up_proj": INTERMEDIATE, "mlp.down_proj": HIDDEN}[hf_sub]
            in_dim = INTERMEDIATE if hf_sub == "mlp.down_proj" else HIDDEN
            heads = {"self_attn.q_proj": HEADS, "self_attn.k_proj": KV_HEADS}.get(hf_sub)
            add_quant(f"model.layers.{i}.{hf_sub}.weight", f"blk.{i}.{gguf_sub}.weight",
                      rng.normal(0, 0.15, (out_dim, in_dim)), overrides.get(hf_sub, qtype), heads)
    add_float("model.norm.weight", "output_norm.weight", np.full(HIDDEN, 4.0))
    if not tied:
        add_quant("lm_head.weight", "output.weight", rng.normal(0, 0.1, (vocab, HIDDEN)),
                  overrides.get("lm_head", qtype), None)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFCase(path, reference, cfg)


def hf_reference_model(case: GGUFCase):
    """transformers' Llama holding the independently dequantized weights, fp32, eager attention."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM._from_config(case.config, attn_implementation="eager").to(torch.float32)
    missing, unexpected = model.load_state_dict(case.reference, strict=False)
    tied = case.config.tie_word_embeddings  # the head is the embedding's parameter
    assert not unexpected and all("rotary" in m or (tied and m == "lm_head.weight") for m in missing), (missing,
                                                                                                        unexpected)
    assert not tied or model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.generation_config.eos_token_id = None
    return model.eval()
