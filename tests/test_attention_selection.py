"""Attention-backend auto-selection with device-aware priorities, and the `flash-attn` backend
where it cannot run: auto never picks a backend that rejects the configuration (and records
why), the built-in priorities order as documented on CPU and on CUDA, naming flash-attn on CPU
fails with its declared reasons, and `fw doctor` explains the rejection and auto's choice."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from conftest import make_llm
from fw.backends.attention import flash_attn
from fw.backends.attention.sdpa import SdpaBackend
from fw.errors import UnsupportedConfigurationError
from fw.plugins import AttentionBackendSpec, AttentionRequirements
from fw.plugins.selection import select_attention_backend
from plugin_fixtures import NoBackend, attention_registry, builtin_manager

pytestmark = pytest.mark.usefixtures("isolated_plugins")

CPU = AttentionRequirements(device="cpu", dtype="float32", head_size=64, page_size=16)
CUDA = AttentionRequirements(device="cuda", dtype="bfloat16", head_size=64, page_size=16)


def _builtin_specs() -> dict[str, AttentionBackendSpec]:
    return {s.name: s for s in builtin_manager().registry("attention_backend")}


def _auto_order(specs, req: AttentionRequirements) -> list[str]:
    """The backends auto would pick in turn, removing each choice: the ranking it applies."""
    specs, order = list(specs), []
    while specs:
        try:
            chosen = select_attention_backend(attention_registry(*specs), req).chosen.name
        except UnsupportedConfigurationError:
            break
        order.append(chosen)
        specs = [s for s in specs if s.name != chosen]
    return order


# -- auto never picks a backend that rejects the configuration ---------------------------------------


def test_auto_skips_a_rejecting_high_priority_backend_and_records_why():
    sdpa = _builtin_specs()["sdpa"]
    registry = attention_registry(
        sdpa,
        AttentionBackendSpec("fast_but_missing", NoBackend, priority=1000, priority_by_device={"cpu": 1000},
                             supports_sliding_window=True, available=lambda: "package fastattn is not installed"),
        AttentionBackendSpec("fast_no_window", NoBackend, priority=900),
    )
    windowed = dataclasses.replace(CPU, sliding_window=128)
    selection = select_attention_backend(registry, windowed)
    assert selection.chosen.name == "sdpa" and not selection.explicit
    assert selection.rejected == {"fast_but_missing": ["package fastattn is not installed"],
                                  "fast_no_window": ["sliding-window attention not supported"]}
    # without the window the feature-less one runs, and wins on its priority
    assert select_attention_backend(registry, CPU).chosen.name == "fast_no_window"


# -- device-aware priorities ---------------------------------------------------------------------------


def test_priority_by_device_overrides_priority_only_on_listed_devices():
    devices = ("cpu", "cuda", "xpu")
    spec = AttentionBackendSpec("x", NoBackend, devices=devices, priority=3, priority_by_device={"cuda": 50, "cpu": -5})
    assert (spec.priority_on("cuda"), spec.priority_on("cpu"), spec.priority_on("xpu")) == (50, -5, 3)
    plain = AttentionBackendSpec("y", NoBackend, devices=devices, priority=7)
    assert plain.priority_on("cuda") == plain.priority_on("cpu") == 7  # specs without it: as before
    assert spec.summary()["priority_by_device"] == {"cuda": 50, "cpu": -5}
    assert "priority_by_device" not in plain.summary()
    hash(spec)  # specs stay hashable with a dict field
    # the same two backends rank differently per device
    specs = [spec, plain]
    assert _auto_order(specs, CPU) == ["y", "x"]
    assert _auto_order(specs, dataclasses.replace(CPU, device="cuda")) == ["x", "y"]
    assert _auto_order(specs, dataclasses.replace(CPU, device="xpu")) == ["y", "x"]


def test_builtin_priorities_on_cpu_prefer_the_measured_fastest():
    """cpu_paged (measured fastest) > sdpa > flex (slower on CPU by measurement); GPU-only ones never."""
    specs = _builtin_specs()
    order = _auto_order(specs.values(), CPU)
    runnable_here = [n for n in ("cpu_paged", "sdpa", "flex") if not specs[n].rejection_reasons(CPU)]
    assert order == runnable_here
    assert "flash-attn" not in order and "triton" not in order
    assert specs["flex"].priority_on("cpu") < specs["sdpa"].priority_on("cpu") < specs["cpu_paged"].priority_on("cpu")


def test_builtin_priorities_on_cuda():
    """On CUDA, with every backend pretending it is available: by priority flash-attn > triton > flex > sdpa;
    verified ones first (docs/attention-backends.md), so on an H200 (sm_90) flash-attn, never verified, comes
    last, and on a GPU where none is verified the order is the priorities'."""
    specs = [dataclasses.replace(s, available=None) for s in _builtin_specs().values()]
    by_priority = sorted((s for s in specs if "cuda" in s.devices), key=lambda s: -s.priority_on("cuda"))
    assert [s.name for s in by_priority] == ["flash-attn", "triton", "flex", "sdpa"]
    sm90 = dataclasses.replace(CUDA, capability=(9, 0))
    assert _auto_order(specs, sm90) == ["triton", "flex", "sdpa", "flash-attn"]
    assert _auto_order(specs, CUDA) == ["triton", "flex", "sdpa", "flash-attn"]  # capability unknown: by type
    sm86 = dataclasses.replace(CUDA, capability=(8, 6))  # no run on sm_86 yet: priorities alone
    assert _auto_order(specs, sm86) == ["flash-attn", "triton", "flex", "sdpa"]


def test_auto_on_cuda_skips_flash_attn_when_its_package_does_not_load():
    specs = {s.name: dataclasses.replace(s, available=None) for s in _builtin_specs().values()}
    specs["flash-attn"] = dataclasses.replace(specs["flash-attn"], available=lambda: "flash_attn does not load")
    selection = select_attention_backend(attention_registry(*specs.values()), CUDA)
    assert selection.chosen.name != "flash-attn"
    assert selection.rejected["flash-attn"] == ["flash_attn does not load"]
    # and fp32 (which FlashAttention does not run) rules it out by its declared dtypes
    fp32 = select_attention_backend(attention_registry(*specs.values()), dataclasses.replace(CUDA, dtype="float32"))
    assert "dtype float32 not supported" in fp32.rejected["flash-attn"][0]


# -- flash-attn where it cannot run -----------------------------------------------------------------


def test_flash_attn_declares_what_it_runs():
    spec = _builtin_specs()["flash-attn"]
    assert spec.devices == ("cuda",) and "float32" not in spec.dtypes
    assert spec.supports_sliding_window and spec.supports_logit_softcap
    why = flash_attn._unavailable()
    if not torch.cuda.is_available():
        assert why is not None and "CUDA" in why


def test_selecting_flash_attn_on_cpu_fails_with_its_reasons():
    registry = builtin_manager().registry("attention_backend")
    with pytest.raises(UnsupportedConfigurationError) as err:
        select_attention_backend(registry, CPU, "flash-attn")
    message = str(err.value)
    assert "attention backend 'flash-attn' cannot run this model here" in message
    assert "device 'cpu' not supported (supports cuda)" in message
    assert "dtype float32 not supported (supports bfloat16, float16)" in message
    assert flash_attn._unavailable() in message
    assert "Backends that would work: " in message and "flash-attn, " not in message.split("would work: ")[1]


def test_engine_with_flash_attn_on_cpu_refuses_to_start(gqa_dir):
    with pytest.raises(UnsupportedConfigurationError, match=r"'flash-attn' cannot run.*device 'cpu' not supported"):
        make_llm(gqa_dir, attention_backend="flash-attn", device="cpu")


def test_doctor_explains_flash_attn_on_cpu_and_what_auto_would_choose(capsys, gqa_dir):
    from fw.cli.main import main

    args = ["doctor", "--model", str(gqa_dir), "--attention-backend", "flash-attn", "--device", "cpu"]
    assert main(args) == 1
    text = capsys.readouterr().out
    section = text.split("\nAttention backend\n", 1)[1].split("\n\n", 1)[0]
    row = next(line for line in section.splitlines() if line.strip().startswith("- flash-attn"))
    assert "rejected (flash_attn, fw) priority 40: device 'cpu' not supported (supports cuda)" in row
    assert flash_attn._unavailable() in row
    auto = select_attention_backend(builtin_manager().registry("attention_backend"),
                                    dataclasses.replace(CPU, head_size=16, dtype="bfloat16")).chosen.name
    assert f"instead: {auto} (auto's choice" in section
    assert f"auto would choose {auto}." in section
    assert "Verdict: this configuration would NOT run" in text

    assert main([*args[:-4], "--device", "cpu", "--json"]) == 0  # auto: runs, flex listed at its CPU priority
    report = json.loads(capsys.readouterr().out)
    rows = {r["name"]: r for r in report["selections"]["attention_backend"]["candidates"]}
    assert rows["flex"]["priority"] == -10 and rows["flash-attn"]["status"] == "rejected"
    resolved = next(r for r in report["config"] if r["name"] == "attention_backend")["resolved"]
    assert resolved["because"].endswith("on cpu)")


# -- CUDA -------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("window,softcap", [(None, None), (64, None), (None, 30.0)], ids=["full", "window", "cap"])
def test_flash_attn_matches_sdpa_bf16_on_cuda(window, softcap):
    if flash_attn._unavailable():
        pytest.skip(f"flash-attn cannot run here: {flash_attn._unavailable()}")
    from test_flex_attention import make_step, run

    page = 256 if flash_attn._installed() == "flash_attn" else 16
    step = make_step(query_lens=[1] * 6 + [100, 37], seq_lens=[1, 16, 17, 300, 511, 64, 180, 37],
                     num_pages=4096 // page + 16, dtype=torch.bfloat16, heads=8, kv_heads=2, head_dim=64,
                     page=page, seed=7)
    want = run(SdpaBackend, step, window=window, softcap=softcap, page=page, device="cuda")
    got = run(flash_attn.FlashAttnBackend, step, window=window, softcap=softcap, page=page, device="cuda")
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
