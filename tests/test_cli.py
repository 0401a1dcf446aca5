"""The `fw` command: version, generate (as a real subprocess), plugins list in
table and JSON form, plugin-provided subcommands and options, and errors a
user can cause reported as one line and a non-zero exit code."""

from __future__ import annotations

import json
import re

import pytest

import plugin_fixtures as pf
from fw.cli.main import build_parser, main
from fw.config import EngineConfig, flag_name
from fw.plugins.manager import PluginManager, reset_plugin_manager
from fw.version import PLUGIN_API_VERSION, __version__

SMALL_KV = ["--num-kv-blocks", "32"]


pytestmark = pytest.mark.usefixtures("isolated_plugins")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return pf.tiny_llama(tmp_path_factory.getbasetemp())


def listed(capsys, *args: str) -> dict[str, dict]:
    reset_plugin_manager()
    assert main(["plugins", "list", "--json", *args]) == 0
    return {row["name"]: row for row in json.loads(capsys.readouterr().out)["plugins"]}


def test_version():
    proc = pf.run_fw("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"fw {__version__} (plugin API {PLUGIN_API_VERSION})"


def test_generate_subprocess_matches_the_library(llama_dir):
    from fw import LLM, SamplingParams

    proc = pf.run_fw("generate", "--model", str(llama_dir), "--prompt", "hello world", "--max-tokens", "5",
                     "--temperature", "0", "--ignore-eos", *SMALL_KV)
    assert proc.returncode == 0, proc.stderr
    expected = LLM(str(llama_dir), num_kv_blocks=32).generate(
        "hello world", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0].outputs[0]
    assert len(expected.token_ids) == 5
    assert proc.stdout == expected.text + "\n"


def test_generate_errors_are_one_line_and_exit_2(llama_dir, tmp_path, capsys):
    assert main(["generate", "--model", str(llama_dir), "--prompt", "hi", "--kv-cache-memory", "lots"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fw: error: --kv-cache-memory") and "Traceback" not in err

    assert main(["generate", "--model", str(tmp_path / "missing"), "--prompt", "hi"]) == 2
    assert "no such file or directory" in capsys.readouterr().err

    with pytest.raises(SystemExit) as exit_info:  # argparse's own check of typed flags
        main(["generate", "--prompt", "hi", "--max-batch-size", "many"])
    assert exit_info.value.code == 2
    assert "--max-batch-size: invalid int value: 'many'" in capsys.readouterr().err


def test_generate_reads_engine_options_from_env_and_yaml(llama_dir, tmp_path, monkeypatch, capsys):
    """FW_* variables and --config reach the engine through `fw generate`."""
    config = tmp_path / "fw.yaml"
    config.write_text(f"model: {llama_dir}\nnum-kv-blocks: 32\n")
    monkeypatch.setenv("FW_ATTENTION_BACKEND", "nonexistent")
    assert main(["generate", "--config", str(config), "--prompt", "hi", "--max-tokens", "2"]) == 2
    assert "no attention backend named 'nonexistent'" in capsys.readouterr().err
    assert main(["generate", "--config", str(config), "--prompt", "hi", "--max-tokens", "2", "--temperature", "0",
                 "--attention-backend", "sdpa"]) == 0


def test_plugins_list_table(capsys):
    assert main(["plugins", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["PLUGIN", "DISTRIBUTION", "VERSION", "API", "STATUS", "PROVIDES"]
    rows = {line.split()[0]: line for line in lines[1:]}
    # an architecture is followed by the Hugging Face classes it serves
    assert re.match(rf"llama\s+fw\s+{re.escape(__version__)}\s+1\.5\s+loaded\s+"
                    r"architecture: llama \(LlamaForCausalLM, MistralForCausalLM\)$", rows["llama"])
    assert re.search(r"loaded\s+attention_backend: sdpa$", rows["sdpa"])
    assert "sampler: logit_bias, min_tokens, penalties, temperature, top_k, top_p, min_p, default" in rows["samplers"]
    # columns line up: every row's STATUS starts where the header's does
    status_col = lines[0].index("STATUS")
    assert all(line[status_col:].startswith("loaded") for line in lines[1:])


def test_plugins_list_json_and_kind_filter(capsys):
    rows = listed(capsys)
    assert {"llama", "sdpa", "samplers"} <= set(rows)
    assert rows["sdpa"] == {
        "name": "sdpa", "distribution": "fw", "version": __version__, "module": "fw.backends.attention.sdpa",
        "api_version": "1.2", "status": "loaded", "error": None, "warnings": [],
        "provides": {"attention_backend": ["sdpa"]}, "overrides": {}, "hf_architectures": {},
    }
    samplers = listed(capsys, "--kind", "sampler")
    assert "samplers" in samplers and all(set(row["provides"]) == {"sampler"} for row in samplers.values())
    assert samplers["samplers"]["provides"] == {"sampler": rows["samplers"]["provides"]["sampler"]}
    architectures = listed(capsys, "--kind", "architecture")
    assert {"llama", "gemma", "qwen", "mixtral", "qwen_moe", "transformers"} <= set(architectures)
    assert all(set(row["provides"]) == {"architecture"} for row in architectures.values())
    assert architectures["qwen"]["hf_architectures"] == {"qwen2": ["Qwen2ForCausalLM"], "qwen3": ["Qwen3ForCausalLM"]}
    assert architectures["transformers"]["hf_architectures"] == {"transformers": []}  # a fallback: any
    grammar = listed(capsys, "--kind", "grammar_backend")
    assert {name: row["provides"] for name, row in grammar.items()} == {
        "xgrammar": {"grammar_backend": ["xgrammar"]}, "outlines": {"grammar_backend": ["outlines"]}}
    parsers = listed(capsys, "--kind", "tool_parser")
    assert {"hermes", "llama3_json"} <= set(parsers)

    with pytest.raises(SystemExit):
        main(["plugins", "list", "--kind", "widgets"])
    assert "invalid choice: 'widgets'" in capsys.readouterr().err


def test_no_command_prints_help(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "generate" in out and "plugins" in out


def test_every_engine_option_is_a_generate_flag():
    parser = build_parser()
    generate = parser._subparsers._group_actions[0].choices["generate"]
    flags = {s for action in generate._actions for s in action.option_strings}
    missing = [flag_name(name) for name in EngineConfig.__dataclass_fields__ if flag_name(name) not in flags]
    assert not missing
    assert "--config" in flags


def test_plugin_subcommand_and_extra_options(root, capsys):
    """Plugins add `fw <name>` subcommands and options on existing ones; a plugin cannot
    take over a core command's name."""
    module = pf.unique("fwtest_cli_plugin")
    source = pf.plugin_source("""
        def configure(parser):
            parser.add_argument("--who", default="world")

        def run(args):
            print(f"hello {args.who} from a plugin")
            return 3

        def fake_generate(args):
            raise AssertionError("a plugin replaced the core generate command")

        @hookimpl
        def fw_register_cli_commands(register):
            register(CliCommandSpec("hello", "Say hello.", configure, run))
            register(CliCommandSpec("generate", "Not the real one.", configure, fake_generate))

        @hookimpl
        def fw_add_cli_arguments(command, parser):
            if command == "generate":
                parser.add_argument("--shout", action="store_true", help="an option from a plugin")
        """, imports="from fw.plugins import CliCommandSpec\n")
    pf.make_distribution(root, "fw-cli-plugin", {module: source}, {"cli_plugin": module})

    assert main(["hello", "--who", "tests"]) == 3
    assert capsys.readouterr().out == "hello tests from a plugin\n"
    reset_plugin_manager()
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = capsys.readouterr().out
    assert "--shout" in help_text and "--prompt" in help_text
    rows = listed(capsys, "--kind", "cli_command")
    assert rows["cli_plugin"]["provides"] == {"cli_command": ["hello", "generate"]}


def test_plugin_command_that_cannot_configure_does_not_break_fw(root, capsys):
    module = pf.unique("fwtest_bad_cli")
    source = pf.plugin_source("""
        def configure(parser):
            raise RuntimeError("my options are broken")

        @hookimpl
        def fw_register_cli_commands(register):
            register(CliCommandSpec("broken", "Never works.", configure, lambda args: 0))

        @hookimpl
        def fw_add_cli_arguments(command, parser):
            raise RuntimeError("cannot add options")
        """, imports="from fw.plugins import CliCommandSpec\n")
    pf.make_distribution(root, "fw-bad-cli", {module: source}, {"bad_cli": module})
    assert main(["plugins", "list", "--json"]) == 0
    captured = capsys.readouterr()
    assert "bad_cli" in captured.out and "failed to add options" in captured.err
    reset_plugin_manager()
    assert main(["broken"]) == 2
    assert "my options are broken" in capsys.readouterr().err


def test_build_parser_without_plugins_has_core_commands():
    parser = build_parser(None)
    commands = parser._subparsers._group_actions[0].choices
    assert set(commands) == {"generate", "serve", "warm-cache", "doctor", "plugins", "bench"}
    parser_with_plugins = build_parser(PluginManager(entry_points=pf.fw_entry_points()).load())
    assert set(parser_with_plugins._subparsers._group_actions[0].choices) == {
        "generate", "serve", "warm-cache", "doctor", "plugins", "bench"}


def test_closed_pipe_is_not_a_traceback():
    """`fw plugins list --json | head` ends quietly when the reader leaves first."""
    import subprocess

    from plugin_fixtures import fw_command

    command = " ".join([*fw_command(), "plugins", "list", "--json"])
    proc = subprocess.run(["bash", "-c", f"set -o pipefail; {command} | true"],
                          capture_output=True, text=True, timeout=120)
    assert "Error" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 0


def test_serve_on_a_port_in_use_fails_before_loading_the_model_naming_the_flag():
    import socket
    import subprocess
    import sys
    import time

    from server_fixtures import server_env

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        start = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "fw.cli.main", "serve", "--port", str(port)], env=server_env(),
                           capture_output=True, text=True, timeout=60)
        took = time.perf_counter() - start
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == (f"fw: error: --port {port}: the port is already in use on 127.0.0.1; stop what "
                                f"listens there or pass another --port"), r.stderr
    assert "loading" not in r.stderr and took < 20, took  # no model was loaded (a load takes longer than this)
