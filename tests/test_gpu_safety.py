"""GPU paths that cannot hurt on their first run, checked on the CPU (issue 21):

* capability needs in the specs: `triton` refuses an fp8 e4m3 KV cache below sm_89 and bf16 below sm_80
  (the same for the triton MoE kernel and flex), with a faked device capability;
* the device guard: each step runs with the engine's device current (`--device cuda:1`);
* `--compile-mode reduce-overhead` / `max-autotune` (CUDA graphs) refused on CUDA, with the reason and
  the alternative, before any weight is read;
* one host buffer and one host-to-device copy of a step's metadata; no device sync in sdpa's prepare;
* one warning when `--quantization` leaves MoE experts dense;
* declared verification: off the CPU auto prefers verified candidates, says why in `fw doctor`, and
  naming an unverified one works with one warning."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging

import pytest
import torch

import plugin_fixtures as pf
from conftest import make_llm
from fw import SamplingParams
from fw.config import EngineConfig
from fw.devices import guard
from fw.errors import UnsupportedConfigurationError
from fw.plugins import AttentionBackendSpec, AttentionRequirements, MoeKernelSpec, MoeRequirements, Verified
from fw.plugins.registry import Registry
from fw.plugins.selection import MoeKernelChooser, select_attention_backend, select_moe_kernel
from fw.plugins.specs import verification
from plugin_fixtures import NoBackend, attention_registry, builtin_manager

pytestmark = pytest.mark.usefixtures("isolated_plugins")

H200 = Verified("cuda", (9, 0), "NVIDIA H200", "2026-11-25", "scripts/gpu_acceptance.sh")
CUDA = AttentionRequirements(device="cuda", dtype="bfloat16", head_size=64, page_size=16)


def _available(spec):
    """The spec as if its package and a GPU were there (this machine has neither)."""
    return dataclasses.replace(spec, available=None)


def _builtin(kind: str) -> dict:
    return {s.name: s for s in builtin_manager().registry(kind)}


def _moe_req(**kw) -> MoeRequirements:
    base = dict(device="cuda", dtype="bfloat16", num_experts=8, top_k=2, hidden_size=64, intermediate_size=32,
                activation="silu")
    return MoeRequirements(**{**base, **kw})


def _moe_registry(*specs) -> Registry:
    registry = Registry("moe_kernel")
    for spec in specs:
        registry.add(spec, spec.name, f"dist-{spec.name}")
    return registry


# -- 1. capability needs ------------------------------------------------------------------------------


@pytest.mark.parametrize("capability, refused", [((8, 0), True), ((8, 6), True), ((8, 9), False), ((9, 0), False)])
def test_triton_refuses_an_fp8_e4m3_cache_below_sm89(capability, refused):
    triton = _available(_builtin("attention_backend")["triton"])
    req = dataclasses.replace(CUDA, kv_cache_dtype="fp8_e4m3", capability=capability)
    reasons = triton.rejection_reasons(req)
    if refused:
        assert reasons == [f"KV cache dtype fp8_e4m3 needs CUDA compute capability 8.9 or newer (sm_89); this GPU "
                           f"is {capability[0]}.{capability[1]}"]
    else:
        assert reasons == []
    assert triton.rejection_reasons(dataclasses.replace(req, kv_cache_dtype="fp8_e5m2")) == []


def test_bf16_needs_sm80_for_the_triton_kernels_and_fp16_does_not():
    attention, moe = _builtin("attention_backend"), _builtin("moe_kernel")
    turing = dataclasses.replace(CUDA, capability=(7, 5))
    for spec in (attention["triton"], attention["flex"]):
        assert "dtype bfloat16 needs CUDA compute capability 8.0 or newer (sm_80); this GPU is 7.5" in \
               _available(spec).rejection_reasons(turing)
        assert _available(spec).rejection_reasons(dataclasses.replace(turing, dtype="float16")) == []
        assert _available(spec).rejection_reasons(dataclasses.replace(turing, capability=(8, 0))) == []
    triton_moe = _available(moe["triton"])
    assert triton_moe.rejection_reasons(_moe_req(capability=(7, 5))) == [
        "dtype bfloat16 needs CUDA compute capability 8.0 or newer (sm_80); this GPU is 7.5"]
    assert triton_moe.rejection_reasons(_moe_req(capability=(8, 0))) == []
    # an unknown capability (None) and the CPU are not judged
    assert _available(attention["triton"]).rejection_reasons(CUDA) == []
    assert attention["sdpa"].rejection_reasons(AttentionRequirements("cpu", "bfloat16", 64, 16)) == []


def test_a_faked_sm80_gpu_keeps_fp8_e4m3_off_triton(monkeypatch, gqa_dir):
    """What the loader reads (torch.cuda.get_device_capability) faked to an A100: auto leaves triton for a
    backend that can, and naming triton fails with the reason."""
    from fw.model.hf import load_hf_config
    from fw.model.loader import attention_requirements

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    cfg = EngineConfig(model=str(gqa_dir), kv_cache_dtype="fp8_e4m3")
    req = attention_requirements(cfg, load_hf_config(gqa_dir, False), torch.bfloat16, torch.device("cuda"))
    assert req.capability == (8, 0) and req.kv_cache_dtype == "fp8_e4m3"
    registry = attention_registry(*map(_available, _builtin("attention_backend").values()))
    selection = select_attention_backend(registry, req)
    assert selection.chosen.name == "sdpa"
    assert "KV cache dtype fp8_e4m3 needs CUDA compute capability 8.9" in selection.rejected["triton"][0]
    with pytest.raises(UnsupportedConfigurationError, match=r"'triton' cannot run.*needs CUDA compute capability 8.9"):
        select_attention_backend(registry, req, "triton")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    req = attention_requirements(cfg, load_hf_config(gqa_dir, False), torch.bfloat16, torch.device("cuda"))
    assert select_attention_backend(registry, req).chosen.name == "triton"


def test_moe_layers_ask_with_their_gpus_capability(monkeypatch):
    from fw.layers import FusedExperts, ModelContext

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    seen = []

    def chooser(req):
        seen.append(req)
        return object()

    ctx = ModelContext(dtype=torch.bfloat16, device=torch.device("cuda", 1), attention_backend=NoBackend,
                       extra={"moe_kernel": chooser})
    FusedExperts(4, 16, 8, 2, ctx, "layers.0.mlp.experts")
    assert seen[0].capability == (7, 5) and seen[0].device == "cuda"
    ctx = dataclasses.replace(ctx, device=torch.device("cpu"))
    FusedExperts(4, 16, 8, 2, ctx, "layers.0.mlp.experts")
    assert seen[1].capability is None


# -- 2. the device guard ------------------------------------------------------------------------------


def test_guard_makes_the_tensors_device_current():
    entered = guard(torch.device("cuda", 1))
    assert isinstance(entered, torch.cuda.device) and entered.idx == 1
    assert isinstance(guard(torch.device("cpu")), contextlib.nullcontext)


def test_every_step_runs_inside_the_device_guard(monkeypatch, gqa_dir):
    """The runner enters the guard for its device around the backend's prepare, the forward and the logits."""
    import fw.engine.model_runner as model_runner

    llm = make_llm(gqa_dir, attention_backend="sdpa")
    runner = llm.engine.runner
    events = []

    @contextlib.contextmanager
    def recording_guard(device):
        events.append(("enter", device))
        yield
        events.append(("exit", device))

    monkeypatch.setattr(model_runner, "device_guard", recording_guard)
    runner.model.register_forward_pre_hook(lambda module, args: events.append(("forward", None)))
    original = runner.model.compute_logits
    monkeypatch.setattr(runner.model, "compute_logits", lambda h: (events.append(("logits", None)), original(h))[1])
    llm.generate(["Hello world", "a"], SamplingParams(temperature=0, max_tokens=3))
    assert events and all(device == runner.device for kind, device in events if kind in ("enter", "exit"))
    depth = 0
    for kind, _ in events:
        depth += {"enter": 1, "exit": -1}.get(kind, 0)
        assert depth in (0, 1) and (kind in ("enter", "exit") or depth == 1)
    assert sum(kind == "forward" for kind, _ in events) == sum(kind == "enter" for kind, _ in events)


# -- 3. CUDA graphs refused ---------------------------------------------------------------------------


def test_cuda_graph_modes_are_those_torch_runs_with_cudagraphs():
    from torch._inductor import list_mode_options

    from fw.compile.modes import CUDA_GRAPH_MODES
    from fw.config import COMPILE_MODES

    assert set(CUDA_GRAPH_MODES) == {m for m in COMPILE_MODES if list_mode_options(m).get("triton.cudagraphs")}


@pytest.mark.parametrize("mode, alternative", [("reduce-overhead", "default"),
                                               ("max-autotune", "max-autotune-no-cudagraphs")])
def test_cuda_graph_modes_are_refused_on_cuda_with_the_reason_and_the_alternative(mode, alternative):
    from fw.compile.modes import check_compile_mode, cuda_graph_refusal

    why = cuda_graph_refusal(mode, "cuda")
    assert why.startswith(f"--compile-mode {mode} captures CUDA graphs")
    assert "per-step metadata" in why and "KV cache" in why and f"Use --compile-mode {alternative}" in why
    with pytest.raises(UnsupportedConfigurationError, match="captures CUDA graphs"):
        check_compile_mode(mode, "cuda")
    for fine_mode, device in ((mode, "cpu"), ("default", "cuda"), ("max-autotune-no-cudagraphs", "cuda"),
                              (None, "cuda")):
        assert cuda_graph_refusal(fine_mode, device) is None
        check_compile_mode(fine_mode, device)


def test_engine_refuses_reduce_overhead_on_cuda_before_loading(monkeypatch, gqa_dir):
    import fw.engine.engine as engine_module
    from fw import LLM

    monkeypatch.setattr(engine_module, "resolve_device", lambda name: torch.device("cuda"))

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the compile mode was checked")

    monkeypatch.setattr(engine_module, "load_model", no_load)
    with pytest.raises(UnsupportedConfigurationError, match="reduce-overhead captures CUDA graphs"):
        LLM(model=str(gqa_dir), device="cuda", compile_mode="reduce-overhead")


# -- 4. one upload per step, no sync in sdpa -------------------------------------------------------------


class _CountingTorch:
    """Stands in for `torch` inside fw.engine.model_runner: counts tensors made from host lists."""

    def __init__(self):
        self.tensors = 0

    def tensor(self, *args, **kwargs):
        self.tensors += 1
        return torch.tensor(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(torch, name)


def test_a_step_builds_its_metadata_in_one_host_tensor(monkeypatch, gqa_dir):
    """Old code: one tensor per metadata field plus one per block-table row plus the sampled rows
    (6 + batch per step); now one, whatever the batch (on CUDA: one pinned buffer, one copy)."""
    import fw.engine.model_runner as model_runner

    llm = make_llm(gqa_dir, attention_backend="sdpa")
    counting = _CountingTorch()
    steps = []
    original = llm.engine.runner.execute

    def execute(seqs, num_new):
        before = counting.tensors
        out = original(seqs, num_new)
        steps.append((len(seqs), counting.tensors - before))
        return out

    monkeypatch.setattr(model_runner, "torch", counting)
    llm.engine.runner.execute = execute
    prompts = ["Hello world", "The engine schedules every request in pages.", "a", "b c d"]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1))
    assert max(batch for batch, _ in steps) >= 4
    assert all(count == 1 for _, count in steps), steps


def test_upload_on_cpu_pins_and_copies_nothing(monkeypatch):
    from fw.engine.model_runner import upload

    def no_pinning(self, *args, **kwargs):
        raise AssertionError("pinned on the CPU")

    monkeypatch.setattr(torch.Tensor, "pin_memory", no_pinning)
    parts = ([5, 6, 7], [], [1], [2, 3])
    views = upload(parts, torch.device("cpu"))
    assert [v.tolist() for v in views] == [list(p) for p in parts]
    assert all(v.dtype == torch.long and v.is_contiguous() for v in views)
    storages = {v.untyped_storage().data_ptr() for v in views}
    assert len(storages) == 1  # views of one tensor: nothing copied per field
    assert all(v.storage_offset() % 2 == 0 for v in views)  # 16-byte aligned starts


class _NoSync(torch.Tensor):
    """A device tensor stand-in: reading it back on the host (a GPU sync) fails the test."""

    def tolist(self):
        raise AssertionError("prepare read a device tensor back to the host")

    def item(self):
        raise AssertionError("prepare read a device tensor back to the host")


def test_sdpa_prepare_reads_no_device_tensor_back(gqa_dir):
    from fw.backends.attention.sdpa import SdpaBackend
    from fw.layers.attention import AttentionMetadata

    query_lens, seq_lens = [1, 1, 5, 3], [9, 4, 5, 10]
    starts = [0, 1, 2, 7, 10]
    meta = AttentionMetadata(
        num_decodes=2, query_lens=query_lens, seq_lens=seq_lens,
        query_start_loc=torch.tensor(starts).as_subclass(_NoSync),
        seq_lens_tensor=torch.tensor(seq_lens), block_tables=torch.arange(16).view(4, 4),
        slot_mapping=torch.arange(10), page_size=4)
    state = SdpaBackend.prepare(meta)
    assert [pf.start for pf in state.prefills] == [2, 7]


# -- 5. dense experts under --quantization ----------------------------------------------------------------


def test_quantizing_a_moe_model_warns_once_that_experts_stay_dense(caplog, tmp_path, tokenizer):
    import tiny_moe

    path = tiny_moe.build_model(tiny_moe.MIXTRAL, tokenizer, tmp_path / "mixtral")
    with caplog.at_level(logging.WARNING, logger="fw"):
        llm = make_llm(path, quantization="fp8")
    dense = [r.getMessage() for r in caplog.records if "stay dense" in r.getMessage()]
    assert len(dense) == 1
    assert dense[0].startswith("quantization fp8: the MoE experts of 2 layers stay dense in float32")
    assert llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=2))[0].outputs[0].token_ids
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fw"):
        make_llm(path)
    assert not [r for r in caplog.records if "stay dense" in r.getMessage()]


# -- 6. declared verification ----------------------------------------------------------------------------


def test_verified_covers_its_device_kind():
    assert H200.covers("cuda", (9, 0)) and not H200.covers("cuda", (8, 0)) and not H200.covers("cpu")
    assert H200.covers("cuda", None)  # capability unknown: judged by the device type
    assert Verified("cpu").covers("cpu") and not Verified("cpu").covers("cuda", (9, 0))
    assert str(H200) == "cuda sm_90 (NVIDIA H200, 2026-11-25, scripts/gpu_acceptance.sh)"
    spec = AttentionBackendSpec("x", NoBackend, verified_on=(Verified("cpu"), H200))
    assert verification(spec, "cuda", (9, 0)) is H200 and verification(spec, "cuda", (8, 9)) is None
    assert spec.summary()["verified_on"] == ["cpu", str(H200)]
    hash(spec)


def _fake_backends():
    return (AttentionBackendSpec("fast_unverified", NoBackend, devices=("cuda",), priority=100),
            AttentionBackendSpec("slow_verified", NoBackend, devices=("cuda",), priority=5, verified_on=(H200,)),
            AttentionBackendSpec("mid_unverified", NoBackend, devices=("cuda",), priority=50))


def test_auto_prefers_a_verified_backend_on_its_gpu_and_says_why():
    registry = attention_registry(*_fake_backends())
    selection = select_attention_backend(registry, dataclasses.replace(CUDA, capability=(9, 0)))
    assert selection.chosen.name == "slow_verified" and selection.verified is H200 and selection.warning is None
    assert selection.passed_over["fast_unverified"] == (
        "not verified on cuda sm_90: auto prefers slow_verified, verified there, over its higher priority (100 > 5)")
    assert selection.passed_over["mid_unverified"].startswith("not verified on cuda sm_90")


def test_with_nothing_verified_on_the_gpu_auto_takes_the_priority_with_a_warning():
    registry = attention_registry(*_fake_backends())
    selection = select_attention_backend(registry, dataclasses.replace(CUDA, capability=(8, 0)))
    assert selection.chosen.name == "fast_unverified" and selection.verified is None
    assert selection.passed_over == {"mid_unverified": "lower priority than fast_unverified",
                                     "slow_verified": "lower priority than fast_unverified"}
    assert selection.warning.startswith("attention backend 'fast_unverified' has not been verified on cuda sm_80")
    assert "auto found no attention backend verified there" in selection.warning


def test_naming_an_unverified_backend_works_with_a_warning():
    registry = attention_registry(*_fake_backends())
    selection = select_attention_backend(registry, dataclasses.replace(CUDA, capability=(9, 0)), "fast_unverified")
    assert selection.chosen.name == "fast_unverified" and selection.explicit
    assert selection.warning == (
        "attention backend 'fast_unverified' has not been verified on cuda sm_90 (no GPU acceptance run of its tests "
        "has passed on this kind of device; verified on: nowhere yet); it runs because --attention-backend names "
        "it. Verified here: slow_verified.")
    assert select_attention_backend(registry, dataclasses.replace(CUDA, capability=(9, 0)),
                                    "slow_verified").warning is None


def test_on_the_cpu_ranking_and_warnings_are_unchanged():
    cpu = AttentionRequirements("cpu", "float32", 64, 16)
    registry = attention_registry(AttentionBackendSpec("third_party", NoBackend, priority=100),
                                  AttentionBackendSpec("verified", NoBackend, priority=1, verified_on=(Verified("cpu"),)))
    selection = select_attention_backend(registry, cpu)
    assert selection.chosen.name == "third_party" and selection.warning is None
    assert selection.passed_over == {"verified": "lower priority than third_party"}


def test_moe_kernels_follow_the_same_rule_and_the_chooser_warns_once(caplog):
    registry = _moe_registry(MoeKernelSpec("fast", NoBackend, devices=("cuda",), priority=10),
                             MoeKernelSpec("verified", NoBackend, devices=("cuda",), priority=0, verified_on=(H200,)))
    req = _moe_req(capability=(9, 0))
    assert select_moe_kernel(registry, req).chosen.name == "verified"
    chooser = MoeKernelChooser(registry, "fast")
    with caplog.at_level(logging.WARNING, logger="fw.plugins"):
        for _ in range(3):  # three MoE layers of one model
            chooser(req)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("MoE kernel 'fast' has not been verified on cuda sm_90")
    assert "--moe-backend names it" in warnings[0]


def test_builtin_declarations_match_the_h200_run():
    """What ran green on the H200 on 2026-11-25 (docs/attention-backends.md, GPU figures): sdpa, triton, flex;
    grouped and triton MoE; gptq, awq, gguf, fp8, bitsandbytes 8-bit and nf4. flash-attn did not run (no wheel),
    nor bitsandbytes fp4. Every CPU path is verified on cpu."""
    manager = builtin_manager()

    def verified(kind: str, device: str, capability=None) -> set[str]:
        return {s.name for s in manager.registry(kind) if verification(s, device, capability)}

    assert verified("attention_backend", "cuda", (9, 0)) == {"sdpa", "triton", "flex"}
    assert verified("moe_kernel", "cuda", (9, 0)) == {"grouped", "triton"}
    assert verified("quantization_method", "cuda", (9, 0)) == {
        "gptq", "awq", "gguf", "fp8", "bitsandbytes-8bit", "bitsandbytes-nf4"}
    for kind in ("attention_backend", "moe_kernel", "quantization_method"):
        cpu_paths = {s.name for s in manager.registry(kind) if "cpu" in s.devices}
        assert verified(kind, "cpu") == cpu_paths
        assert not verified(kind, "cuda", (8, 0))  # nothing has run on an A100 yet
    attention = _builtin("attention_backend")
    on_h200 = dataclasses.replace(CUDA, capability=(9, 0))
    selection = select_attention_backend(attention_registry(*map(_available, attention.values())), on_h200)
    assert selection.chosen.name == "triton"
    assert selection.passed_over["flash-attn"].startswith("not verified on cuda sm_90: auto prefers triton")


def test_an_unverified_quantization_method_on_a_gpu_warns(monkeypatch, caplog, gqa_dir):
    from fw.model.hf import load_hf_config
    from fw.model.loader import _quantization

    manager = builtin_manager()
    arch = manager.registry("architecture").get("llama")
    hf_config = load_hf_config(gqa_dir, False)
    cuda = torch.device("cuda")
    for capability, warned in (((9, 0), False), ((8, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fw.loader"):
            name, _ = _quantization(EngineConfig(model=str(gqa_dir), quantization="fp8"), hf_config, arch, manager,
                                    cuda)
        assert name == "fp8"
        messages = [r.getMessage() for r in caplog.records if "has not been verified" in r.getMessage()]
        assert len(messages) == int(warned)
        if warned:
            assert messages[0].startswith("quantization method 'fp8' has not been verified on cuda sm_80")
            assert "--quantization names it" in messages[0]


def _fake_gpu_plugin(root) -> None:
    module = pf.unique("fwtest_verified")
    source = pf.plugin_source("""
        H200 = Verified("cuda", (9, 0), "NVIDIA H200", "2026-11-25", "scripts/gpu_acceptance.sh")

        @hookimpl
        def fw_register_attention_backends(register):
            register(AttentionBackendSpec("fast_unverified", object, devices=("cuda",), priority=100))
            register(AttentionBackendSpec("slow_verified", object, devices=("cuda",), priority=50, verified_on=(H200,)))
        """, api_version="1.2", imports="from fw.plugins import Verified\n")
    pf.make_distribution(root, "fw-verified", {module: source}, {"verified": module})


def test_doctor_on_a_faked_h200_says_why_an_unverified_faster_backend_was_passed_over(capsys, monkeypatch, root,
                                                                                      gqa_dir):
    import fw.plan.rules as loader  # the device rule: fw.plan resolves the device for doctor and the engine
    from fw.cli.main import main

    _fake_gpu_plugin(root)
    monkeypatch.setattr(loader, "resolve_device", lambda name: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert main(["doctor", "--model", str(gqa_dir), "--device", "cuda", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    attention = report["selections"]["attention_backend"]
    rows = {row["name"]: row for row in attention["candidates"]}
    assert attention["chosen"] == "slow_verified" and attention["requirements"]["capability"] == [9, 0]
    assert rows["fast_unverified"]["status"] == "accepted" and rows["fast_unverified"]["verified"] is None
    assert rows["fast_unverified"]["note"] == ("not verified on cuda sm_90: auto prefers slow_verified, verified "
                                               "there, over its higher priority (100 > 50)")
    assert rows["slow_verified"]["verified"] == str(Verified("cuda", (9, 0), "NVIDIA H200", "2026-11-25",
                                                             "scripts/gpu_acceptance.sh"))
    resolved = next(r for r in report["config"] if r["name"] == "attention_backend")["resolved"]
    assert "among those verified on cuda sm_90 first" in resolved["because"]
    assert not report["warnings"]

    # named: it runs, with one warning in the report
    assert main(["doctor", "--model", str(gqa_dir), "--device", "cuda", "--attention-backend", "fast_unverified"]) == 0
    text = capsys.readouterr().out
    section = text.split("\nAttention backend\n", 1)[1].split("\n\n", 1)[0]
    assert "chosen: fast_unverified" in section
    assert "WARNING: attention backend 'fast_unverified' has not been verified on cuda sm_90" in section
    assert "{verified on cuda sm_90 (NVIDIA H200, 2026-11-25, scripts/gpu_acceptance.sh)}" in section
    assert "\nWarnings\n    - attention backend 'fast_unverified' has not been verified" in text


def test_doctor_refuses_reduce_overhead_on_a_gpu(capsys, monkeypatch, gqa_dir):
    import fw.plan.rules as loader  # the device rule: fw.plan resolves the device for doctor and the engine
    from fw.cli.main import main

    monkeypatch.setattr(loader, "resolve_device", lambda name: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert main(["doctor", "--model", str(gqa_dir), "--device", "cuda", "--compile-mode", "reduce-overhead",
                 "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert any(p.startswith("--compile-mode reduce-overhead captures CUDA graphs") for p in report["problems"])


# -- on a real GPU (pytest -m gpu tests/test_gpu_safety.py; skipped without CUDA) -------------------------


@pytest.mark.gpu
def test_gpu_capability_is_read_and_auto_prefers_what_was_verified_on_it():
    from fw.devices import cuda_capability, gpu_name

    capability = torch.cuda.get_device_capability()
    assert cuda_capability(torch.device("cuda")) == capability and gpu_name(torch.device("cuda"))
    req = dataclasses.replace(CUDA, capability=capability)
    selection = select_attention_backend(builtin_manager().registry("attention_backend"), req)
    if capability == (9, 0) and not selection.rejected.get("triton"):
        assert selection.chosen.name == "triton" and selection.verified is not None and selection.warning is None
    elif not any(verification(s, "cuda", capability) for s in _builtin("attention_backend").values()):
        assert selection.warning and "has not been verified" in selection.warning
    fp8 = dataclasses.replace(req, kv_cache_dtype="fp8_e4m3")
    triton_reasons = _builtin("attention_backend")["triton"].rejection_reasons(fp8)
    assert any("8.9" in r for r in triton_reasons) == (capability < (8, 9))


@pytest.mark.gpu
def test_gpu_upload_is_one_pinned_copy_with_the_right_values():
    from fw.engine.model_runner import upload

    parts = ([5, 6, 7], [], [1], list(range(100)))
    views = upload(parts, torch.device("cuda"))
    torch.cuda.synchronize()
    assert all(v.device.type == "cuda" for v in views)
    assert [v.tolist() for v in views] == [list(p) for p in parts]
    assert len({v.untyped_storage().data_ptr() for v in views}) == 1


@pytest.mark.gpu
def test_gpu_steps_upload_once_run_with_their_device_current_and_match_the_cpu(monkeypatch, gqa_dir):
    import fw.engine.model_runner as model_runner

    prompts = ["Hello world", "The engine schedules every request in pages.", "a", "b c d"]
    params = SamplingParams(temperature=0, max_tokens=6)
    want = [o.outputs[0].token_ids for o in make_llm(gqa_dir, attention_backend="sdpa").generate(prompts, params)]
    index = torch.cuda.device_count() - 1  # the last GPU: not the current device when there are several
    llm = make_llm(gqa_dir, device=f"cuda:{index}")
    runner = llm.engine.runner
    current = []
    runner.model.register_forward_pre_hook(lambda module, args: current.append(torch.cuda.current_device()))
    counting, counts = _CountingTorch(), []
    original = runner.execute

    def execute(seqs, num_new):
        before = counting.tensors
        out = original(seqs, num_new)
        counts.append(counting.tensors - before)
        return out

    monkeypatch.setattr(model_runner, "torch", counting)
    runner.execute = execute
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want
    assert counts and set(counts) == {1}
    assert current and set(current) == {index}


@pytest.mark.gpu
def test_gpu_refuses_cuda_graph_modes_and_runs_fp8_e4m3_on_triton_where_it_compiles(gqa_dir):
    with pytest.raises(UnsupportedConfigurationError, match="captures CUDA graphs"):
        make_llm(gqa_dir, device="cuda", compile_mode="reduce-overhead")
    if torch.cuda.get_device_capability() < (8, 9):
        llm = make_llm(gqa_dir, device="cuda", kv_cache_dtype="fp8_e4m3")
        assert llm.engine.loaded.attention.chosen.name != "triton"
    else:
        llm = make_llm(gqa_dir, device="cuda", kv_cache_dtype="fp8_e4m3", attention_backend="triton")
    assert llm.generate(["Hello world"], SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].token_ids
