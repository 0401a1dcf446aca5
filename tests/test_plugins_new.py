"""`fw plugins new`: every kind's generated package installs (pip, into a private target directory,
offline, so no other test sees it), `fw plugins list` finds it through its entry point, and its own
tests, fw's conformance suite included, pass in a fresh process; and the command's errors say what
to do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from fw.version import PLUGIN_API_VERSION
from fw.cli.main import main
from fw.cli.plugins_cmd import SCAFFOLD_KINDS
from fw.errors import ConfigError
from fw.commands.scaffold import KINDS, PluginNames, new_plugin

# kind -> the NAME each is generated under (hyphenated: the names derived from it must all agree)
NAMES = {"architecture": "tiny-arch", "attention": "loop-attn", "quantization": "int8-channel",
         "sampler": "top-nsigma", "grammar": "choice-trie"}

# NAME -> the transformers class `--hf-class` ports under it
PORTS = {"olmo2-port": "Olmo2ForCausalLM"}


def fresh_env(site: Path) -> dict[str, str]:
    """The environment of a new process that sees the installed packages (and no FW_* settings)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FW_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH", "")) if p)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", FW_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    """One package per kind, written by the CLI and pip-installed together into `site`."""
    base = tmp_path_factory.mktemp("plugins_new")
    packages = {}
    for kind, name in NAMES.items():
        assert main(["plugins", "new", "--kind", kind, name, "--output", str(base / "src")]) == 0
        packages[kind] = base / "src" / PluginNames.from_name(name).distribution
    for name, hf_class in PORTS.items():  # ports of transformers classes, their tests with transformers as the oracle
        assert main(["plugins", "new", "--kind", "architecture", "--hf-class", hf_class, name,
                     "--output", str(base / "src")]) == 0
        packages[name] = base / "src" / PluginNames.from_name(name).distribution
    site = base / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "--disable-pip-version-check", "--target", str(site),
                    *map(str, packages.values())], check=True, capture_output=True, text=True, timeout=300)
    return site, packages


def test_cli_kinds_are_the_scaffold_kinds():
    assert set(SCAFFOLD_KINDS) == set(KINDS) == set(NAMES)


def test_fw_plugins_list_shows_each_generated_plugin(installed):
    site, _ = installed
    run = subprocess.run([sys.executable, "-m", "fw.cli.main", "plugins", "list", "--json"], env=fresh_env(site),
                         capture_output=True, text=True, timeout=120, cwd=site)
    assert run.returncode == 0, run.stderr
    rows = {r["name"]: r for r in json.loads(run.stdout)["plugins"]}
    for kind, name in NAMES.items():
        names = PluginNames.from_name(name)
        row = rows[names.entry_point]
        assert (row["distribution"], row["version"], row["status"], row["api_version"]) == \
            (names.distribution, "0.1.0", "loaded", KINDS[kind].min_api_version), row
        assert row["provides"] == {KINDS[kind].registry_kind: [name]}
    # each architecture plugin's row says which Hugging Face architectures it serves
    assert rows[PluginNames.from_name(NAMES["architecture"]).entry_point]["hf_architectures"] == \
        {"tiny-arch": ["TinyArchForCausalLM"]}
    assert rows["llama"]["hf_architectures"] == {"llama": ["LlamaForCausalLM", "MistralForCausalLM"]}


def test_generated_packages_pass_their_own_tests(installed):
    """All six test directories (five kinds and a port) in one pytest process (imports are paid once);
    each must have run its own tests and its conformance suite, with nothing failing."""
    site, packages = installed
    report = site.parent / "report.xml"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
                          *(str(p / "tests") for p in packages.values())],
                         env=fresh_env(site), capture_output=True, text=True, timeout=600, cwd=site.parent)
    outcomes: dict[str, dict[str, int]] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")  # ...tests.test_fw_x[.TestConformance]
        cls = parts[-1] if parts[-1].startswith("Test") else ""
        module = parts[-2] if cls else parts[-1]
        failure = case.find("failure") if case.find("failure") is not None else case.find("error")
        outcome = "skipped" if case.find("skipped") is not None else "failed" if failure is not None else "passed"
        key = ("conformance_" if cls == "TestConformance" else "own_") + outcome
        counts = outcomes.setdefault(module, {})
        counts[key] = counts.get(key, 0) + 1
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    for kind, name in [*NAMES.items(), *(("architecture port", n) for n in PORTS)]:
        module = "test_" + PluginNames.from_name(name).package
        counts = outcomes.get(module, {})
        assert not counts.get("own_failed") and not counts.get("conformance_failed"), (kind, counts, run.stdout[-6000:])
        assert counts.get("own_passed", 0) >= 2, (kind, counts)
        assert counts.get("conformance_passed", 0) >= 1, (kind, counts)


def test_generated_files_are_consistent(tmp_path):
    """Without installing: the Python parses, pyproject's entry point names the plugin module, and the
    spec registers NAME."""
    for kind, name in NAMES.items():
        root = new_plugin(kind, name, tmp_path)
        names = PluginNames.from_name(name)
        project = tomllib.loads((root / "pyproject.toml").read_text())
        assert project["project"]["name"] == names.distribution
        assert project["project"]["entry-points"]["fw"] == {names.entry_point: f"{names.package}.plugin"}
        assert project["tool"]["setuptools"]["packages"] == [names.package]
        for source in root.rglob("*.py"):
            compile(source.read_text(), str(source), "exec")
        plugin = (root / names.package / "plugin.py").read_text()
        # the oldest API with what the template uses, so the package loads on every fw since
        assert f'"{name}"' in plugin and 'FW_PLUGIN_API_VERSION = "%s"' % KINDS[kind].min_api_version in plugin
        assert _version(KINDS[kind].min_api_version) <= _version(PLUGIN_API_VERSION)
        tests = (root / "tests" / f"test_{names.package}.py").read_text()
        assert f'conformance_suite("{KINDS[kind].registry_kind}", "{name}"' in tests
        readme = (root / "README.md").read_text()
        assert "## What to change" in readme and f"fw plugins list --kind {KINDS[kind].registry_kind}" in readme


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")
    return int(major), int(minor)


def test_plugins_list_table_shows_hf_architectures(capsys):
    assert main(["plugins", "list", "--kind", "architecture"]) == 0
    out = capsys.readouterr().out
    assert "architecture: llama (LlamaForCausalLM, MistralForCausalLM)" in out
    assert "transformers (any, as a fallback)" in out


@pytest.mark.parametrize("example", ["fw-example-arch", "fw-sampler-dry"])
def test_example_is_written_out_as_shipped(example, tmp_path, capsys):
    """What a pip user gets from `fw plugins new --example`: the package with its tests, file for file
    what fw's repository holds under plugins/ (sources, README, pyproject; no build leftovers)."""
    assert main(["plugins", "new", "--example", example, "--output", str(tmp_path)]) == 0
    assert f"Wrote {tmp_path / example}/" in capsys.readouterr().out
    source = Path(__file__).resolve().parent.parent / "plugins" / example
    shipped = {str(p.relative_to(source)) for p in source.rglob("*")
               if p.is_file() and p.suffix in (".py", ".md", ".toml") and "egg-info" not in str(p)
               and "__pycache__" not in str(p)}
    written = {str(p.relative_to(tmp_path / example)) for p in (tmp_path / example).rglob("*") if p.is_file()}
    assert written == shipped and any(w.startswith("tests/") for w in written)
    for relative in written:
        assert (tmp_path / example / relative).read_text() == (source / relative).read_text()


def test_example_errors(tmp_path, capsys):
    err = error_of(["--example", "fw-nope", "--output", str(tmp_path)], capsys)
    assert "no example plugin named 'fw-nope'; examples: fw-example-arch (" in err and "fw-sampler-xtc (" in err
    (tmp_path / "fw-sampler-xtc").mkdir()
    err = error_of(["--example", "fw-sampler-xtc", "--output", str(tmp_path)], capsys)
    assert "already exists; choose another --output directory" in err
    with pytest.raises(SystemExit):
        main(["plugins", "new", "--example", "fw-sampler-xtc", "--kind", "sampler", "--output", str(tmp_path)])
    assert "--example writes an existing example package; it takes no --kind or --hf-class" in capsys.readouterr().err


def test_wheel_ships_the_examples():
    """pyproject's package-data for fw.commands.scaffold matches every file `--example` writes."""
    setup = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = setup["package-data"]["fw.commands.scaffold"]
    from fw.commands.scaffold.examples import EXAMPLES, example_files

    for example in EXAMPLES:
        for relative in example_files(example):
            assert any(Path("examples", example, relative).match(p) for p in patterns), (example, relative)


@pytest.mark.parametrize("name, derived", [
    ("my-backend", ("fw-my-backend", "fw_my_backend", "my_backend", "MyBackend")),
    ("int8_rows", ("fw-int8-rows", "fw_int8_rows", "int8_rows", "Int8Rows")),
    ("fw-dry2", ("fw-dry2", "fw_dry2", "dry2", "Dry2")),
])
def test_names_derived_from_name(name, derived):
    n = PluginNames.from_name(name)
    assert (n.name, n.distribution, n.package, n.entry_point, n.camel) == (name, *derived)


def error_of(args: list[str], capsys) -> str:
    assert main(["plugins", "new", *args]) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("bad", ["My-Backend", "9lives", "my--backend", "my backend", "_x", "fw", "a" * 41, "x.y"])
def test_invalid_names_are_refused(bad, tmp_path, capsys):
    err = error_of(["--kind", "sampler", bad, "--output", str(tmp_path)], capsys)
    assert f"fw: error: invalid plugin name {bad!r}" in err and "e.g. 'my-backend'" in err
    assert not any(tmp_path.iterdir())


def test_existing_directory_is_refused(tmp_path, capsys):
    (tmp_path / "fw-my-sampler").mkdir()
    err = error_of(["--kind", "sampler", "my-sampler", "--output", str(tmp_path)], capsys)
    assert f"{str(tmp_path / 'fw-my-sampler')!r} already exists; choose another NAME or --output directory" in err
    assert not any((tmp_path / "fw-my-sampler").iterdir())


def test_output_that_is_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "f").write_text("")
    err = error_of(["--kind", "grammar", "g", "--output", str(tmp_path / "f")], capsys)
    assert "--output" in err and "is a file, not a directory" in err


def test_names_already_installed_are_refused(tmp_path, capsys):
    err = error_of(["--kind", "attention", "sdpa", "--output", str(tmp_path)], capsys)
    assert "an attention backend named 'sdpa' is already installed; choose another NAME" in err
    assert "fw plugins list --kind attention_backend" in err
    err = error_of(["--kind", "sampler", "samplers", "--output", str(tmp_path)], capsys)
    assert "the entry-point name 'samplers' is already used by the installed distribution 'fw'" in err
    assert not any(tmp_path.iterdir())


def test_unknown_kind_and_missing_kind_are_usage_errors(tmp_path, capsys):
    for args in (["--kind", "tokenizer", "x"], ["x"]):
        with pytest.raises(SystemExit) as exit_:
            main(["plugins", "new", *args, "--output", str(tmp_path)])
        assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'tokenizer'" in err and "the following arguments are required: --kind" in err
    with pytest.raises(ConfigError, match="unknown plugin kind 'tokenizer'; choose one of: architecture, attention"):
        new_plugin("tokenizer", "x", tmp_path)
