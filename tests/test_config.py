"""EngineConfig as the one source of truth: a flag, an FW_* variable and a YAML
key per field; precedence defaults < YAML < environment < CLI; bad values are
ConfigErrors that name the option."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from fw.config import (
    _fields,
    EngineConfig,
    add_config_arguments,
    env_name,
    flag_name,
    load_yaml_options,
    parse_size,
    resolve_config,
)
from fw.errors import ConfigError

FIELDS = [f.name for f in dataclasses.fields(EngineConfig)]

# One non-default value per field, as typed on the command line and as parsed.
# A new EngineConfig field must be added here (test_every_field_has_a_sample fails otherwise).
SAMPLES: dict[str, tuple[list[str], object]] = {
    "model": (["--model", "some/model"], "some/model"),
    "revision": (["--revision", "v2"], "v2"),
    "tokenizer": (["--tokenizer", "tok/dir"], "tok/dir"),
    "chat_template": (["--chat-template", "{{ messages[0].content }}"], "{{ messages[0].content }}"),
    "trust_remote_code": (["--trust-remote-code"], True),
    "dtype": (["--dtype", "bfloat16"], "bfloat16"),
    "device": (["--device", "cpu"], "cpu"),
    "seed": (["--seed", "7"], 7),
    "max_length": (["--max-length", "512"], 512),
    "attention_backend": (["--attention-backend", "sdpa"], "sdpa"),
    "sampling_backend": (["--sampling-backend", "mine"], "mine"),
    "grammar_backend": (["--grammar-backend", "outlines"], "outlines"),
    "tool_call_parser": (["--tool-call-parser", "hermes"], "hermes"),
    "quantization": (["--quantization", "fp8"], "fp8"),
    "quantization_encoding": (["--quantization-encoding", "q4_k"], "q4_k"),
    "enable_structured_output": (["--no-enable-structured-output"], False),
    "gguf_dequantize_at_load": (["--gguf-dequantize-at-load"], True),
    "rope_type": (["--rope-type", "neox"], "neox"),
    "kv_cache_page_size": (["--kv-cache-page-size", "32"], 32),
    "kv_cache_dtype": (["--kv-cache-dtype", "fp8_e4m3"], "fp8_e4m3"),
    "kv_cache_memory": (["--kv-cache-memory", "512MiB"], "512MiB"),
    "device_memory_utilization": (["--device-memory-utilization", "0.5"], 0.5),
    "num_kv_blocks": (["--num-kv-blocks", "100"], 100),
    "enable_prefix_caching": (["--no-enable-prefix-caching"], False),
    "max_batch_size": (["--max-batch-size", "8"], 8),
    "max_batch_input_tokens": (["--max-batch-input-tokens", "256"], 256),
    "prefill_chunk_size": (["--prefill-chunk-size", "64"], 64),
    "custom_architectures": (["--custom-architectures", "a.py", "--custom-architectures", "d:m"], ["a.py", "d:m"]),
    "strict_plugins": (["--strict-plugins"], True),
    "num_threads": (["--num-threads", "2"], 2),
    "moe_backend": (["--moe-backend", "grouped"], "grouped"),
    "model_impl": (["--model-impl", "transformers"], "transformers"),
    "task": (["--task", "embed"], "embed"),
    "enable_lora": (["--enable-lora"], True),
    "lora_modules": (["--lora-modules", "a=/x", "--lora-modules", "b=/y"], ["a=/x", "b=/y"]),
    "max_loras": (["--max-loras", "2"], 2),
    "max_cpu_loras": (["--max-cpu-loras", "16"], 16),
    "max_lora_rank": (["--max-lora-rank", "32"], 32),
    "pooling": (["--pooling", "mean"], "mean"),
    "normalize_embeddings": (["--no-normalize-embeddings"], False),
    "enable_torch_compile": (["--enable-torch-compile"], True),
    "compile_mode": (["--compile-mode", "max-autotune-no-cudagraphs"], "max-autotune-no-cudagraphs"),
    "bucketing": (["--bucketing", "linear"], "linear"),
    "bucket_tokens_min": (["--bucket-tokens-min", "4"], 4),
    "bucket_tokens_step": (["--bucket-tokens-step", "64"], 64),
    "bucket_tokens_max": (["--bucket-tokens-max", "512"], 512),
    "bucket_batch_min": (["--bucket-batch-min", "2"], 2),
    "bucket_batch_step": (["--bucket-batch-step", "4"], 4),
    "bucket_batch_max": (["--bucket-batch-max", "16"], 16),
    "skip_warmup": (["--skip-warmup"], True),
    "compile_cache_dir": (["--compile-cache-dir", "/tmp/fw-compile"], "/tmp/fw-compile"),
    "compile_cache_size_mb": (["--compile-cache-size-mb", "100"], 100),
    "speculative_config": (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'],
                           {"method": "ngram", "num_speculative_tokens": 3}),
    "tensor_parallel_size": (["--tensor-parallel-size", "2"], 2),
    "distributed_executor_backend": (["--distributed-executor-backend", "mp"], "mp"),
    "data_parallel_size": (["--data-parallel-size", "2"], 2),
    "nnodes": (["--nnodes", "2"], 2),
    "node_rank": (["--node-rank", "1"], 1),
    "dist_init_addr": (["--dist-init-addr", "10.0.0.1:29500"], "10.0.0.1:29500"),
    "dist_init_timeout": (["--dist-init-timeout", "30"], 30.0),
    "dist_timeout": (["--dist-timeout", "10"], 10.0),
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_config_arguments(p)
    return p


def from_cli(argv: list[str], environ: dict[str, str] | None = None) -> EngineConfig:
    args = parser().parse_args(argv)
    return resolve_config(cli=vars(args), config_file=args.config, environ=environ or {})


def env_text(value: object) -> str:
    if isinstance(value, dict):  # a JSON object option
        return json.dumps(value)
    if isinstance(value, list):
        return ",".join(value)
    return str(value).lower() if isinstance(value, bool) else str(value)


def test_every_field_has_a_sample():
    assert set(SAMPLES) == set(FIELDS)


@pytest.mark.parametrize("name", FIELDS)
def test_every_field_has_a_flag_an_env_var_and_a_yaml_key(name, tmp_path):
    argv, expected = SAMPLES[name]
    default = getattr(EngineConfig(), name)
    assert expected != default
    assert getattr(from_cli(argv), name) == expected
    assert getattr(resolve_config(environ={env_name(name): env_text(expected)}), name) == expected
    config = tmp_path / "c.yaml"
    import yaml

    config.write_text(yaml.safe_dump({flag_name(name)[2:]: expected}))
    assert getattr(resolve_config(config_file=str(config), environ={}), name) == expected
    # unset everywhere: the dataclass default
    assert getattr(from_cli([]), name) == default


def test_flags_are_declared_once_per_field():
    flags = [s for a in parser()._actions for s in a.option_strings if s.startswith("--")]
    assert sorted(set(flags)) == sorted(flags)
    names = {f.name: [flag_name(f.name), *(alias for alias, _ in f.metadata.get("aliases", ()))]
             for f in dataclasses.fields(EngineConfig)}
    booleans = {f.name for f, tp in _fields(EngineConfig) if tp is bool}  # bool and bool | None fields
    expected = {flag for n in FIELDS for flag in names[n]}
    expected |= {f"--no-{flag_name(n)[2:]}" for n in booleans}  # a switch's alias has no --no- form
    assert set(flags) == expected | {"--config", "--help"}


# The seeds' names for fw's options (issue 19): each reaches the same field as fw's own flag.
ALIASES = [
    (["--model-path", "some/model"], "model", "some/model"),  # SGLang
    (["--model-id", "some/model"], "model", "some/model"),  # TGI
    (["--devices", "cpu"], "device", "cpu"),  # MAX
    (["--devices", "gpu"], "device", "cuda"),
    (["--devices", "gpu:1"], "device", "cuda:1"),
    (["--max-model-len", "512"], "max_length", 512),  # vLLM
    (["--max-total-tokens", "512"], "max_length", 512),  # TGI
    (["--quantize", "gptq"], "quantization", "gptq"),  # TGI
    (["--max-num-seqs", "8"], "max_batch_size", 8),  # vLLM
    (["--max-running-requests", "8"], "max_batch_size", 8),  # SGLang
    (["--max-num-batched-tokens", "256"], "max_batch_input_tokens", 256),  # vLLM
    (["--max-batch-prefill-tokens", "256"], "max_batch_input_tokens", 256),  # TGI
    (["--skip-server-warmup"], "skip_warmup", True),  # SGLang
    (["--tp", "2"], "tensor_parallel_size", 2),  # SGLang
    (["--tp-size", "2"], "tensor_parallel_size", 2),  # SGLang
    (["--num-shard", "2"], "tensor_parallel_size", 2),  # TGI
]


@pytest.mark.parametrize("argv, name, expected", ALIASES, ids=[" ".join(a[0]) for a in ALIASES])
def test_a_seed_systems_flag_name_reaches_the_same_field(argv, name, expected):
    own = [flag_name(name), *argv[1:]] if not argv[0].startswith("--devices") else ["--device", argv[1]]
    assert getattr(from_cli(argv), name) == expected == getattr(from_cli(own), name)


@pytest.mark.parametrize("argv, name, expected", [
    (["--disable-log-requests"], "log_requests", False),  # vLLM: the same as --no-log-requests
    (["--json-output"], "json_logs", True),  # TGI
    (["--no-enable-echo"], "enable_echo", False),  # MAX's own flag (default on in fw)
])
def test_a_seed_systems_server_flag_reaches_the_same_field(argv, name, expected):
    from fw.server.config import ServerConfig

    p = argparse.ArgumentParser()
    add_config_arguments(p, ServerConfig, "server options")

    def resolve(args: list[str], environ: dict[str, str]) -> ServerConfig:
        return resolve_config(cli=vars(p.parse_args(args)), environ=environ, cls=ServerConfig)

    assert getattr(resolve(argv, {}), name) == expected
    assert getattr(resolve(argv, {env_name(name): str(not expected).lower()}), name) == expected  # the CLI wins
    assert getattr(resolve([], {env_name(name): str(not expected).lower()}), name) == (not expected)


# MAX's --quantization-encoding: each value reaches the fw option with the same meaning (a GGUF weight type is
# checked against the file when the model is resolved: tests/test_max_flags.py)
ENCODINGS = [("float32", "dtype", "float32"), ("bfloat16", "dtype", "bfloat16"),
             ("float8_e4m3fn", "quantization", "fp8"), ("gptq", "quantization", "gptq"),
             ("Q4_K", "quantization", None)]


@pytest.mark.parametrize("encoding, name, expected", ENCODINGS, ids=[e[0] for e in ENCODINGS])
def test_a_quantization_encoding_reaches_fws_own_option(encoding, name, expected):
    config = from_cli(["--quantization-encoding", encoding])
    assert config.quantization_encoding == encoding.lower()
    assert getattr(config, name) == expected
    if expected is not None:
        assert getattr(from_cli([flag_name(name), expected]), name) == expected
        assert from_cli([flag_name(name), expected, "--quantization-encoding", encoding]).quantization_encoding


@pytest.mark.parametrize("argv, words", [
    (["--quantization-encoding", "float4_e2m1fnx2"], ["--quantization-encoding", "NVFP4", "accepted: float32"]),
    (["--quantization-encoding", "int3"], ["--quantization-encoding 'int3'", "accepted:", "q6_k"]),
    (["--quantization-encoding", "float32", "--dtype", "bfloat16"], ["means --dtype float32", "--dtype bfloat16"]),
    (["--quantization-encoding", "gptq", "--quantize", "awq"], ["means --quantization gptq", "awq"]),
])
def test_a_quantization_encoding_fw_cannot_honour_is_refused_naming_the_flag(argv, words):
    with pytest.raises(ConfigError) as err:
        from_cli(argv)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_a_chat_template_is_a_file_or_the_template_itself(tmp_path):
    from fw.chat_template import load_chat_template

    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert load_chat_template(str(path)) == path.read_text()
    assert from_cli(["--chat-template", str(path)]).chat_template == str(path)
    # inline: a shell passes \n as two characters, read as a newline (vLLM); other characters kept as they are
    assert load_chat_template("{{ 'é' }}\\n日本") == "{{ 'é' }}\n日本"


@pytest.mark.parametrize("value, words", [
    ("missing.jinja", ["--chat-template missing.jinja: no such file"]),
    ("{% for m in messages %}", ["--chat-template (the template given inline): not a valid Jinja template",
                                 "line 1"]),
    ("\n  \n", ["the template is empty"]),
])
def test_a_chat_template_that_cannot_be_used_fails_at_start_up_naming_the_flag(value, words):
    with pytest.raises(ConfigError) as err:
        from_cli(["--chat-template", value])
    assert all(w in str(err.value) for w in words), str(err.value)
    with pytest.raises(ConfigError, match="--chat-template"):
        resolve_config(environ={"FW_CHAT_TEMPLATE": value})


def test_a_broken_template_file_names_its_line(tmp_path):
    path = tmp_path / "bad.jinja"
    path.write_text("ok\n{{ messages[0] ")
    with pytest.raises(ConfigError, match=rf"--chat-template {path}: not a valid Jinja template: .*line 2"):
        EngineConfig(chat_template=str(path))


def test_several_devices_are_refused_naming_the_flag():
    with pytest.raises(ConfigError, match=r"--device gpu:0,1: one device only"):
        from_cli(["--devices", "gpu:0,1"])


def test_the_step_budget_defaults_by_device_to_what_performance_md_chose():
    """--max-batch-input-tokens: the CPU default for generation is the one docs/performance.md measured and
    chose; GPUs and embedding models keep 2048; a value given wins on either."""
    import re
    from pathlib import Path

    from fw.config import CPU_STEP_TOKENS, GPU_STEP_TOKENS

    doc = (Path(__file__).resolve().parent.parent / "docs" / "performance.md").read_text()
    chosen = re.search(r"CPU default of `--max-batch-input-tokens` is \*\*(\d+)\*\*", doc)
    assert chosen, "docs/performance.md no longer states the CPU step budget"
    assert EngineConfig(device="cpu").step_tokens == CPU_STEP_TOKENS == int(chosen.group(1))
    assert EngineConfig(device="cpu", task="embed").step_tokens == GPU_STEP_TOKENS
    assert EngineConfig(device="cuda").step_tokens == EngineConfig(device="gpu:1").step_tokens == GPU_STEP_TOKENS
    assert GPU_STEP_TOKENS == 2048
    assert EngineConfig(device="cpu", max_batch_input_tokens=2048).step_tokens == 2048
    assert EngineConfig(device="cpu", task="embed", max_batch_input_tokens=300).step_tokens == 300
    assert from_cli(["--device", "cpu", "--max-num-batched-tokens", "1024"]).step_tokens == 1024
    assert from_cli(["--device", "cpu"]).chunk_size == CPU_STEP_TOKENS


def test_precedence_defaults_yaml_env_cli(tmp_path):
    config = tmp_path / "fw.yaml"
    config.write_text(
        "max-batch-size: 8\n"           # YAML, overridden by env and CLI
        "seed: 5\n"                      # YAML, overridden by env
        "kv_cache_page_size: 32\n"       # YAML only
        "enable_prefix_caching: false\n"  # YAML, overridden by the CLI
    )
    environ = {"FW_MAX_BATCH_SIZE": "16", "FW_SEED": "6", "FW_DEVICE": "cpu"}
    cfg = from_cli(["--config", str(config), "--max-batch-size", "24", "--enable-prefix-caching"], environ)
    assert cfg.max_batch_size == 24
    assert cfg.seed == 6
    assert cfg.kv_cache_page_size == 32
    assert cfg.enable_prefix_caching is True
    assert cfg.device == "cpu"
    assert cfg.max_batch_input_tokens == EngineConfig().max_batch_input_tokens

    without_cli = from_cli(["--config", str(config)], environ)
    assert (without_cli.max_batch_size, without_cli.enable_prefix_caching) == (16, False)
    # FW_CONFIG names the file when --config is not given
    via_env = from_cli([], {"FW_CONFIG": str(config)})
    assert (via_env.max_batch_size, via_env.seed) == (8, 5)


def test_library_keywords_act_like_cli_values():
    cfg = resolve_config(environ={"FW_MAX_BATCH_SIZE": "16"}, max_batch_size=4, model="m")
    assert (cfg.max_batch_size, cfg.model) == (4, "m")
    with pytest.raises(ConfigError, match="unknown engine option 'max_batch'"):
        resolve_config(environ={}, max_batch=4)


@pytest.mark.parametrize("text, value", [("0", False), ("false", False), ("No", False), ("off", False),
                                          ("1", True), ("TRUE", True), ("yes", True), ("on", True)])
def test_boolean_environment_values(text, value):
    assert resolve_config(environ={"FW_ENABLE_PREFIX_CACHING": text}).enable_prefix_caching is value


def test_bad_values_name_the_option(tmp_path):
    def error(argv=(), environ=None, yaml_text=None) -> str:
        config_argv = []
        if yaml_text is not None:
            (tmp_path / "bad.yaml").write_text(yaml_text)
            config_argv = ["--config", str(tmp_path / "bad.yaml")]
        with pytest.raises(ConfigError) as err:
            from_cli([*argv, *config_argv], environ)
        return str(err.value)

    assert "--kv-cache-memory" in error(["--kv-cache-memory", "lots"])
    assert "512MiB" in error(["--kv-cache-memory", "lots"])  # says what to write instead
    assert "--kv-cache-memory" in error(environ={"FW_KV_CACHE_MEMORY": "lots"})
    assert "--kv-cache-page-size must be positive" in error(["--kv-cache-page-size", "0"])
    assert "--device-memory-utilization" in error(["--device-memory-utilization", "1.5"])
    assert "--max-batch-size" in error(["--max-batch-size", "-1"])
    assert "--num-kv-blocks" in error(["--num-kv-blocks", "0"])
    assert "--prefill-chunk-size" in error(["--prefill-chunk-size", "0"])

    assert "FW_MAX_BATCH_SIZE" in error(environ={"FW_MAX_BATCH_SIZE": "many"})
    assert "FW_ENABLE_PREFIX_CACHING" in error(environ={"FW_ENABLE_PREFIX_CACHING": "maybe"})
    assert "--dtype must be one of" in error(environ={"FW_DTYPE": "float8"})

    unknown = error(yaml_text="max_batch_size: 4\nmax_bach_size: 8\n")
    assert "unknown option 'max_bach_size'" in unknown and "bad.yaml" in unknown
    assert "max_batch_size" in unknown  # lists the known keys
    assert "max_batch_size" in error(yaml_text="max_batch_size: lots\n")
    assert "not valid YAML" in error(yaml_text="max_batch_size: [\n")
    assert "expected a mapping" in error(yaml_text="- a\n- b\n")
    with pytest.raises(ConfigError, match="no such file"):
        load_yaml_options(tmp_path / "missing.yaml")


def test_dataclass_validates_library_use():
    with pytest.raises(ConfigError, match="--kv-cache-memory"):
        EngineConfig(kv_cache_memory="lots")
    with pytest.raises(ConfigError, match="--dtype"):
        EngineConfig(dtype="float8")
    assert EngineConfig(prefill_chunk_size=None, max_batch_input_tokens=100).chunk_size == 100
    assert EngineConfig(prefill_chunk_size=10).chunk_size == 10


@pytest.mark.parametrize("text, size", [("1GiB", 2**30), ("512MiB", 512 * 2**20), ("2gb", 2 * 10**9),
                                         ("1.5 KiB", 1536), ("4096", 4096), (1234, 1234), ("10b", 10)])
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["lots", "", "1 GiG", "-5MiB", "MiB"])
def test_parse_size_rejects(text):
    with pytest.raises(ConfigError, match="cannot read size"):
        parse_size(text)


def test_list_option_from_env_and_yaml(tmp_path):
    assert resolve_config(environ={"FW_CUSTOM_ARCHITECTURES": "a.py, pkg.mod"}).custom_architectures == [
        "a.py", "pkg.mod"]
    (tmp_path / "c.yaml").write_text("custom-architectures:\n  - x.py\n  - d:m\n")
    assert resolve_config(config_file=str(tmp_path / "c.yaml"), environ={}).custom_architectures == ["x.py", "d:m"]
