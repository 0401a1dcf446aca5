"""Choosing implementations: `--custom-architectures` (overriding built-ins
visibly, per engine) and attention-backend selection with the reasons every
rejected candidate gives."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

import plugin_fixtures as pf
from fw.errors import ConfigError, UnknownImplementationError, UnsupportedConfigurationError
from fw.plugins import AttentionBackendSpec, AttentionRequirements
from fw.plugins.manager import reset_plugin_manager
from fw.plugins.selection import select_attention_backend
from plugin_fixtures import NoBackend, attention_registry, builtin_manager, greedy, small_llm

pytestmark = pytest.mark.usefixtures("isolated_plugins")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return pf.tiny_llama(tmp_path_factory.getbasetemp())


# -- --custom-architectures -------------------------------------------------------------------------


def custom_module(directory: Path, spec_name: str, forced_token: int, api_version: str = "1.0") -> str:
    """A user's module (not a plugin distribution) whose ARCHITECTURES holds a Llama that
    always predicts `forced_token`, so generation shows which architecture ran."""
    name = pf.unique("fwtest_custom_arch")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.py").write_text(textwrap.dedent(f"""
        import torch
        from fw.architectures.llama import LlamaForCausalLM
        from fw.plugins import ArchitectureSpec

        FW_PLUGIN_API_VERSION = {api_version!r}
        FORCED = {forced_token}

        class ForcedLlama(LlamaForCausalLM):
            def compute_logits(self, hidden):
                logits = torch.zeros(hidden.shape[0], self.config.vocab_size, dtype=torch.float32)
                logits[:, FORCED] = 1.0
                return logits

        ARCHITECTURES = [ArchitectureSpec(
            name={spec_name!r}, hf_architectures=("LlamaForCausalLM",),
            build=lambda cfg, ctx, max_positions=None: ForcedLlama(cfg, ctx, max_positions),
        )]
        """))
    return name


def forced_token(llama_dir: Path) -> tuple[int, str]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(llama_dir))
    token = tokenizer.encode("hello", add_special_tokens=False)[0]
    return token, tokenizer.decode([token])


def test_custom_architecture_overrides_builtin_llama(tmp_path, llama_dir):
    token, _ = forced_token(llama_dir)
    module = custom_module(tmp_path, "llama", token)
    manager = builtin_manager()
    manager.add_custom_architectures([f"{tmp_path}:{module}"])
    registration = manager.registry("architecture").registration("llama")
    assert registration.plugin == f"custom:{module}"
    assert registration.overrides == ["fw"]
    row = next(r for r in manager.inventory() if r["name"] == f"custom:{module}")
    assert row["overrides"] == {"architecture": ["llama (from fw)"]}
    assert row["distribution"].startswith("custom (") and row["status"] == "loaded"

    llm = small_llm(str(llama_dir), plugins=manager)
    assert llm.generate("one two", greedy(max_tokens=5))[0].outputs[0].token_ids == [token] * 5


def test_custom_architecture_under_its_own_name_is_used(tmp_path, llama_dir):
    """A custom module is an explicit choice: it wins for the HF names it claims even
    when its spec is not named like the built-in it shadows."""
    token, _ = forced_token(llama_dir)
    module = custom_module(tmp_path, "forced-llama", token)
    llm = small_llm(str(llama_dir), plugins=builtin_manager(), custom_architectures=[f"{tmp_path}:{module}"])
    assert llm.engine.loaded.architecture.name == "forced-llama"
    assert llm.generate("one two", greedy(max_tokens=3))[0].outputs[0].token_ids == [token] * 3


def test_custom_architectures_stay_with_their_engine(tmp_path, llama_dir):
    """An engine started with --custom-architectures must not change what later engines load."""
    token, _ = forced_token(llama_dir)
    module = custom_module(tmp_path, "llama", token)
    reset_plugin_manager()
    custom = small_llm(str(llama_dir), custom_architectures=[f"{tmp_path}:{module}"])
    assert custom.generate("one two", greedy(max_tokens=3))[0].outputs[0].token_ids == [token] * 3
    plain = small_llm(str(llama_dir))
    assert plain.engine.loaded.architecture.build is not custom.engine.loaded.architecture.build
    assert plain.generate("one two", greedy(max_tokens=3))[0].outputs[0].token_ids != [token] * 3


def test_custom_architectures_from_the_cli(tmp_path, llama_dir, capsys):
    from fw.cli.main import main

    token, text = forced_token(llama_dir)
    module = custom_module(tmp_path / "dir", "llama", token)
    assert main(["plugins", "list", "--json", "--custom-architectures", f"{tmp_path / 'dir'}:{module}"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["plugins"]}
    assert rows[f"custom:{module}"]["provides"] == {"architecture": ["llama"]}
    assert rows[f"custom:{module}"]["overrides"] == {"architecture": ["llama (from fw)"]}

    reset_plugin_manager()
    file_module = custom_module(tmp_path / "file", "llama", token)
    assert main(["generate", "--model", str(llama_dir), "--prompt", "one two", "--max-tokens", "4",
                 "--num-kv-blocks", "32", "--temperature", "0", "--ignore-eos",
                 "--custom-architectures", str(tmp_path / "file" / f"{file_module}.py")]) == 0
    assert capsys.readouterr().out == text * 4 + "\n"


def test_bad_custom_architectures(tmp_path):
    manager = builtin_manager()
    (tmp_path / "fwtest_no_archs.py").write_text("X = 1\n")
    with pytest.raises(ConfigError, match="must define a non-empty ARCHITECTURES"):
        manager.add_custom_architectures([str(tmp_path / "fwtest_no_archs.py")])
    with pytest.raises(ConfigError, match="no such file"):
        manager.add_custom_architectures([str(tmp_path / "missing.py")])
    with pytest.raises(ConfigError, match=r"could not import it \(ModuleNotFoundError"):
        manager.add_custom_architectures([f"{tmp_path}:fwtest_not_there"])
    future = custom_module(tmp_path, "llama", 1, api_version="2.0")
    with pytest.raises(ConfigError, match="targets plugin API 2.0"):
        manager.add_custom_architectures([f"{tmp_path}:{future}"])
    assert manager.registry("architecture").registration("llama").distribution == "fw"


# -- attention backend selection ------------------------------------------------------------------


CPU_FP32 = AttentionRequirements(device="cpu", dtype="float32", head_size=64, page_size=16)


def test_auto_picks_the_highest_priority_usable_backend():
    registry = attention_registry(
        AttentionBackendSpec("reference", NoBackend, priority=0),
        AttentionBackendSpec("fast", NoBackend, priority=10),
        AttentionBackendSpec("gpu_only", NoBackend, devices=("cuda",), priority=100),
        AttentionBackendSpec("missing_pkg", NoBackend, priority=50, available=lambda: "package foo is not installed"),
        AttentionBackendSpec("bf16_only", NoBackend, dtypes=("bfloat16",), priority=40),
    )
    selection = select_attention_backend(registry, CPU_FP32)
    assert selection.chosen.name == "fast" and not selection.explicit
    assert set(selection.rejected) == {"gpu_only", "missing_pkg", "bf16_only"}
    assert selection.rejected["missing_pkg"] == ["package foo is not installed"]
    assert select_attention_backend(registry, CPU_FP32, "auto").chosen.name == "fast"
    explicit = select_attention_backend(registry, CPU_FP32, "reference")
    assert explicit.chosen.name == "reference" and explicit.explicit


def test_explicit_backend_that_cannot_run_lists_reasons_and_alternatives():
    registry = attention_registry(
        AttentionBackendSpec("reference", NoBackend),
        AttentionBackendSpec("fast", NoBackend, priority=10),
        AttentionBackendSpec("gpu_only", NoBackend, devices=("cuda",), head_sizes=(128,)),
    )
    with pytest.raises(UnsupportedConfigurationError) as err:
        select_attention_backend(registry, CPU_FP32, "gpu_only")
    message = str(err.value)
    assert "'gpu_only' cannot run" in message
    assert "device 'cpu' not supported (supports cuda)" in message
    assert "head size 64 not supported (supports [128])" in message
    assert "Backends that would work: fast, reference." in message
    with pytest.raises(UnknownImplementationError, match="registered: fast, gpu_only, reference"):
        select_attention_backend(registry, CPU_FP32, "nonexistent")
    with pytest.raises(UnsupportedConfigurationError, match="no attention backend can run.*gpu_only: device"):
        select_attention_backend(attention_registry(AttentionBackendSpec("gpu_only", NoBackend, devices=("cuda",))), CPU_FP32)


def test_backend_selection_through_the_engine(root, llama_dir):
    """A plugin's GPU-only backend is refused on CPU with reasons; a usable higher-priority
    backend is chosen by auto and actually runs."""
    module = pf.unique("fwtest_gpu_backend")
    source = pf.plugin_source("""
        @hookimpl
        def fw_register_attention_backends(register):
            register(AttentionBackendSpec("gpu_only", object, devices=("cuda",), priority=100))
        """)
    manager = builtin_manager(pf.make_distribution(root, "fw-gpu-backend", {module: source}, {"gpu": module}))
    with pytest.raises(UnsupportedConfigurationError,
                       match=r"'gpu_only' cannot run.*device 'cpu' not supported.*would work: cpu_paged, sdpa, flex\."):
        small_llm(str(llama_dir), plugins=manager, attention_backend="gpu_only")
    with pytest.raises(UnknownImplementationError, match="registered: cpu_paged, flash-attn, flex, gpu_only, sdpa, triton"):
        small_llm(str(llama_dir), plugins=manager, attention_backend="nonexistent")

    sdpa = manager.registry("attention_backend").get("sdpa").backend_cls
    calls = []

    class CountingSdpa(sdpa):
        def forward(self, *args, **kwargs):
            calls.append(1)
            return super().forward(*args, **kwargs)

    manager.registry("attention_backend").add(
        AttentionBackendSpec("counting", CountingSdpa, priority=50), "tests", "tests")
    llm = small_llm(str(llama_dir), plugins=manager)
    assert llm.engine.loaded.attention.chosen.name == "counting"
    assert "gpu_only" in llm.engine.loaded.attention.rejected
    tokens = llm.generate("hello", greedy(max_tokens=3))[0].outputs[0].token_ids
    assert calls and len(tokens) == 3
    reference = small_llm(str(llama_dir), plugins=manager, attention_backend="sdpa")
    assert reference.generate("hello", greedy(max_tokens=3))[0].outputs[0].token_ids == tokens


def test_cli_unknown_attention_backend(llama_dir, capsys):
    from fw.cli.main import main

    code = main(["generate", "--model", str(llama_dir), "--prompt", "hi", "--attention-backend", "nonexistent",
                 "--num-kv-blocks", "32"])
    assert code == 2
    err = capsys.readouterr().err
    assert "no attention backend named 'nonexistent'; registered: cpu_paged, flash-attn, flex, sdpa, triton" in err
