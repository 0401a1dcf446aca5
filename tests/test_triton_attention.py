"""The `triton` attention backend.

On CPU: its kernels under the Triton interpreter against `sdpa` (tests/triton_interpreter_cases.py,
run in a child pytest with TRITON_INTERPRET=1, which must be set before triton's first import and
so cannot be set in this process without changing it for every later test), and its spec: CUDA
only, refused on CPU with its reasons. On CUDA (`pytest -m gpu tests/test_triton_attention.py`):
the same comparisons at bf16/fp16/fp8 KV on larger shapes, and greedy generation equal to sdpa."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from conftest import make_llm
from fw import SamplingParams
from fw.plugins.specs import AttentionRequirements
from plugin_fixtures import builtin_manager
from triton_scenarios import Scenario, compare

HERE = Path(__file__).parent
HAS_TRITON = importlib.util.find_spec("triton") is not None


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_kernels_match_sdpa_under_the_interpreter(tmp_path):
    """Every interpreter case ran and passed; a skipped one fails this test (CI has triton, so nothing may
    quietly not run)."""
    report = tmp_path / "report.xml"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", f"--junitxml={report}",
         str(HERE / "triton_interpreter_cases.py")],
        cwd=HERE.parent, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    suite = ET.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    assert counts["tests"] >= 20 and counts["failures"] == counts["errors"] == counts["skipped"] == 0, counts


def test_importing_the_plugin_leaves_triton_unimported():
    """Listing plugins loads the module; triton's import (and its TRITON_INTERPRET choice) waits for use."""
    code = ("import sys; import fw.backends.attention.triton_backend as t; "
            "assert 'triton' not in sys.modules, 'imported'; print(t.unavailable())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.usefixtures("isolated_plugins")
def test_spec_is_cuda_only_and_refused_on_cpu_with_reasons():
    from fw.errors import UnsupportedConfigurationError
    from fw.plugins.selection import select_attention_backend

    registry = builtin_manager().registry("attention_backend")
    spec = registry.get("triton")
    assert spec.devices == ("cuda",) and spec.priority > registry.get("sdpa").priority
    assert spec.supports_sliding_window and spec.supports_logit_softcap
    assert {"fp8_e4m3", "fp8_e5m2"} <= set(spec.kv_cache_dtypes)
    cpu = AttentionRequirements(device="cpu", dtype="float32", head_size=64, page_size=16)
    with pytest.raises(UnsupportedConfigurationError, match=r"'triton' cannot run.*device 'cpu' not supported"):
        select_attention_backend(registry, cpu, "triton")
    assert select_attention_backend(registry, cpu).chosen.name != "triton"  # auto skips it on CPU
    cuda = AttentionRequirements(device="cuda", dtype="bfloat16", head_size=300, page_size=16)
    assert any("head size 300" in r for r in spec.rejection_reasons(cuda))
    if not torch.cuda.is_available():
        assert "no CUDA device" in " ".join(spec.rejection_reasons(cuda))


# -- CUDA ------------------------------------------------------------------------------------------

def _backends():
    from fw.backends.attention.sdpa import SdpaBackend
    from fw.backends.attention.triton_backend import TritonBackend

    return TritonBackend, SdpaBackend


LONG = [(1000, 1), (2047, 1), (16, 1), (4095, 1), (0, 300), (500, 129), (63, 65)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 3e-2), (torch.float16, 1e-2), (torch.float32, 1e-4)],
                         ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("features", [{}, {"sliding_window": 256}, {"logit_softcap": 30.0},
                                      {"sliding_window": 100, "logit_softcap": 5.0}],
                         ids=["plain", "window", "softcap", "window-softcap"])
def test_gpu_matches_sdpa(dtype, tol, features):
    triton_cls, sdpa_cls = _backends()
    s = Scenario(LONG, heads=32, kv_heads=8, head_dim=128, page_size=16, dtype=dtype, **features)
    compare(s, triton_cls, sdpa_cls, device="cuda", tol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["fp8_e4m3", "fp8_e5m2"])
def test_gpu_fp8_kv_cache_matches_sdpa(kv_dtype):
    triton_cls, sdpa_cls = _backends()
    s = Scenario(LONG, heads=16, kv_heads=4, head_dim=64, page_size=16, dtype=torch.bfloat16, kv_dtype=kv_dtype,
                 k_scale=0.5, v_scale=0.25)
    compare(s, triton_cls, sdpa_cls, device="cuda", tol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,page", [(80, 16), (256, 32), (64, 1)], ids=["d80", "d256", "page1"])
def test_gpu_shapes_match_sdpa(head_dim, page):
    triton_cls, sdpa_cls = _backends()
    s = Scenario(LONG[:3] + LONG[4:], heads=8, kv_heads=8, head_dim=head_dim, page_size=page, dtype=torch.bfloat16)
    compare(s, triton_cls, sdpa_cls, device="cuda", tol=3e-2)


@pytest.mark.gpu
def test_gpu_greedy_generation_matches_sdpa(gqa_dir):
    prompts = ["a", "Hello world", "The engine schedules every request in pages of keys and values.",
               "def add(a, b):\n    return a + b\n\nprint(add(2, 3))"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    results = {}
    for name in ("triton", "sdpa"):
        llm = make_llm(gqa_dir, attention_backend=name, device="cuda", kv_cache_page_size=4)
        assert llm.engine.loaded.attention.chosen.name == name
        results[name] = [out.outputs[0] for out in llm.generate(prompts, params)]
    for got, want in zip(results["triton"], results["sdpa"]):
        assert got.token_ids == want.token_ids
        for a, b, token in zip(got.logprobs, want.logprobs, got.token_ids):
            assert abs(a[token].logprob - b[token].logprob) < 1e-3


def test_uneven_head_groups_are_refused_with_what_to_do():
    from fw.backends.attention.triton_backend import TritonBackend
    from fw.errors import UnsupportedConfigurationError

    with pytest.raises(UnsupportedConfigurationError, match="6 query heads for 4 KV heads.*--attention-backend sdpa"):
        TritonBackend(6, 4, 16, 0.25)
