"""The plugin system: discovery through entry points, failure isolation, strict
mode, name conflicts and overrides, allow/block lists, API versions, the
dependency rule, and the example third-party plugin (plugins/fw-example-plugin)
installed the way a user installs it. Selection (custom architectures,
attention backends) is in test_plugin_selection.py."""

from __future__ import annotations

import importlib.metadata
import json
import re
import sys
from pathlib import Path

import pytest

import plugin_fixtures as pf
from fw.version import PLUGIN_API_VERSION
from fw.errors import DuplicatePluginNameError, PluginLoadError, UnsupportedArchitectureError
from fw.plugins import SamplerSpec
from fw.plugins.manager import PluginManager, reset_plugin_manager
from plugin_fixtures import builtin_manager, greedy, small_llm

pytestmark = pytest.mark.usefixtures("isolated_plugins")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return tmp_path_factory.getbasetemp()


@pytest.fixture(scope="module")
def example_site(base) -> Path:
    """plugins/fw-example-plugin pip-installed into a directory, importable for this module's tests."""
    site = pf.install_example_plugin(base)
    sys.path.insert(0, str(site))
    yield site
    sys.path.remove(str(site))


@pytest.fixture(scope="module")
def llama_dir(base) -> Path:
    return pf.tiny_llama(base)


@pytest.fixture(scope="module")
def example_dir(base) -> Path:
    return pf.tiny_llama(base, ("ExampleLlamaForCausalLM",))


@pytest.fixture(scope="module")
def example_llm(example_site, example_dir):
    return small_llm(str(example_dir), plugins=PluginManager(entry_points=pf.fw_entry_points(example_site)).load())


def broken_distribution(root: Path, plugin: str = "broken") -> Path:
    module = pf.unique("fwtest_broken")
    return pf.make_distribution(root, "fw-broken-plugin", {module: pf.BROKEN_PLUGIN}, {plugin: module})


def sampler_distribution(root: Path, dist: str, stage: str, override: bool = False,
                         api_version: str | None = "1.0", plugin: str | None = None) -> Path:
    module = pf.unique("fwtest_sampler")
    return pf.make_distribution(root, dist, {module: pf.sampler_plugin(stage, override, api_version)},
                                {plugin or dist.replace("-", "_"): module})


# -- the example plugin, installed ------------------------------------------------------------


def test_example_plugin_listed_by_cli_next_to_a_broken_one(example_site, tmp_path):
    broken = broken_distribution(tmp_path)
    rows = pf.plugins_json(pf.run_fw("plugins", "list", "--json", pythonpath=[example_site, broken]))

    example = rows["example"]
    assert example["distribution"] == "fw-example-plugin"
    assert example["version"] == "0.1.0"
    assert example["module"] == "fw_example_plugin.plugin"
    assert example["api_version"] == "1.0"
    assert example["status"] == "loaded" and example["error"] is None
    assert example["provides"] == {"architecture": ["example-llama"], "sampler": ["banned_tokens"]}

    assert rows["broken"]["status"] == "error"
    assert rows["broken"]["distribution"] == "fw-broken-plugin"
    assert "RuntimeError: example plugin is broken on purpose" in rows["broken"]["error"]
    for name in ("llama", "sdpa", "samplers"):
        assert rows[name]["status"] == "loaded", rows[name]

    strict = pf.run_fw("plugins", "list", pythonpath=[example_site, broken], env={"FW_STRICT_PLUGINS": "1"})
    assert strict.returncode != 0
    assert "strict-plugins" in strict.stderr and "broken (fw-broken-plugin)" in strict.stderr
    assert "example plugin is broken on purpose" in strict.stderr
    assert "Traceback" not in strict.stderr


def test_example_architecture_generates_like_transformers(example_llm, example_dir):
    assert example_llm.engine.loaded.architecture.name == "example-llama"
    out = example_llm.generate("hello world", greedy(max_tokens=8))[0]
    assert len(out.outputs[0].token_ids) == 8
    assert out.outputs[0].token_ids == pf.hf_greedy(example_dir, out.prompt_token_ids, 8)


def test_example_architecture_parallel_residual_variant(example_site, example_llm, base):
    parallel_dir = pf.tiny_llama(base, ("ExampleLlamaForCausalLM",), parallel_residual=True)
    llm = small_llm(str(parallel_dir), plugins=builtin_manager(example_site))
    assert llm.engine.loaded.model.model.layers[0].parallel is True
    parallel = llm.generate("hello world", greedy(max_tokens=8))[0].outputs[0].token_ids
    sequential = example_llm.generate("hello world", greedy(max_tokens=8))[0].outputs[0].token_ids
    assert len(parallel) == 8
    assert parallel != sequential  # same weights, different block wiring


def test_example_architecture_comes_from_the_plugin(example_dir):
    with pytest.raises(UnsupportedArchitectureError, match="ExampleLlamaForCausalLM"):
        small_llm(str(example_dir), plugins=builtin_manager())


def test_banned_tokens_stage(example_llm):
    from fw import SamplingParams

    plain = example_llm.generate("hello world", greedy(max_tokens=8))[0].outputs[0].token_ids
    banned = sorted(set(plain))
    ban = greedy(max_tokens=8, extra_args={"banned_token_ids": banned + [10**6]})
    # One batch: the banning row and a plain row; the plain row must be untouched.
    with_ban, without = example_llm.generate(["hello world", "hello world"], [ban, greedy(max_tokens=8)])
    assert not set(with_ban.outputs[0].token_ids) & set(banned)
    assert len(with_ban.outputs[0].token_ids) == 8
    assert without.outputs[0].token_ids == plain

    sampled = SamplingParams(max_tokens=30, temperature=1.5, seed=3, ignore_eos=True,
                             extra_args={"banned_token_ids": banned})
    tokens = example_llm.generate("hello world", sampled)[0].outputs[0].token_ids
    assert len(tokens) == 30 and not set(tokens) & set(banned)


# -- failure isolation and strict mode ------------------------------------------------------------


def test_broken_plugin_is_reported_and_the_rest_works(root, llama_dir):
    manager = builtin_manager(broken_distribution(root))
    info = manager.plugins["broken"]
    assert info.distribution == "fw-broken-plugin"
    assert info.error == "RuntimeError: example plugin is broken on purpose"
    row = next(r for r in manager.inventory() if r["name"] == "broken")
    assert row["status"] == "error" and row["provides"] == {}
    assert [p.name for p in manager.failures()] == ["broken"]
    assert {"llama", "sdpa", "samplers"} <= {n for n, p in manager.plugins.items() if p.error is None}

    llm = small_llm(str(llama_dir), plugins=manager)
    assert len(llm.generate("hello", greedy(max_tokens=4))[0].outputs[0].token_ids) == 4
    with pytest.raises(PluginLoadError, match="broken"):
        small_llm(str(llama_dir), plugins=manager, strict_plugins=True)


def test_strict_mode_argument_and_environment(root, monkeypatch):
    root = broken_distribution(root)
    with pytest.raises(PluginLoadError, match=r"1 plugin\(s\) failed.*broken \(fw-broken-plugin\).*RuntimeError"):
        builtin_manager(root, strict=True)
    monkeypatch.setenv("FW_STRICT_PLUGINS", "1")
    with pytest.raises(PluginLoadError, match="broken on purpose"):
        builtin_manager(root)
    monkeypatch.setenv("FW_STRICT_PLUGINS", "0")
    assert builtin_manager(root).plugins["broken"].error


def test_strict_mode_from_the_cli(root, monkeypatch, capsys):
    from fw.cli.main import main

    broken_distribution(root)
    assert main(["plugins", "list"]) == 0
    table = capsys.readouterr().out
    assert re.search(r"broken\s+fw-broken-plugin.*error: RuntimeError: example plugin is broken", table)

    reset_plugin_manager()
    assert main(["plugins", "list", "--strict-plugins"]) != 0
    err = capsys.readouterr().err
    assert "fw: error: --strict-plugins" in err and "broken on purpose" in err

    reset_plugin_manager()
    monkeypatch.setenv("FW_STRICT_PLUGINS", "1")
    assert main(["plugins", "list"]) != 0
    assert "broken on purpose" in capsys.readouterr().err


def test_cli_flag_beats_strict_environment(root, monkeypatch, capsys, llama_dir):
    """Precedence is env < CLI for FW_STRICT_PLUGINS too: --no-strict-plugins wins."""
    from fw.cli.main import main

    broken_distribution(root)
    monkeypatch.setenv("FW_STRICT_PLUGINS", "1")
    assert main(["generate", "--model", str(llama_dir), "--prompt", "hi", "--max-tokens", "1",
                 "--num-kv-blocks", "32", "--no-strict-plugins"]) == 0
    assert "fw: error" not in capsys.readouterr().err
    reset_plugin_manager()
    assert main(["generate", "--model", str(llama_dir), "--prompt", "hi", "--max-tokens", "1"]) == 2
    assert "broken on purpose" in capsys.readouterr().err


def test_plugin_whose_hook_raises_is_reported(root):
    module = pf.unique("fwtest_hook_raises")
    source = pf.plugin_source("""
        @hookimpl
        def fw_register_samplers(register):
            raise ValueError("cannot build my sampler")
        """)
    root = pf.make_distribution(root, "fw-hook-raises", {module: source}, {"hook_raises": module})
    manager = builtin_manager(root)
    assert manager.plugins["hook_raises"].error == "fw_register_samplers raised ValueError: cannot build my sampler"
    assert "default" in manager.registry("sampler")


def test_plugin_failing_half_way_registers_nothing(root):
    """All or nothing: what a plugin registered before its hook raised is withdrawn."""
    module = pf.unique("fwtest_half_way")
    source = pf.plugin_source("""
        class Stage:
            def is_active(self, params):
                return True

            def apply(self, logits, batch):
                return logits * 0

        @hookimpl
        def fw_register_samplers(register):
            register(SamplerSpec("half_way_stage", Stage, order=5))
            raise ValueError("the second sampler is broken")
        """, imports="from fw.plugins import SamplerSpec\n")
    root = pf.make_distribution(root, "fw-half-way", {module: source}, {"half_way": module})
    manager = builtin_manager(root)
    assert "the second sampler is broken" in manager.plugins["half_way"].error
    assert "half_way_stage" not in manager.registry("sampler")
    assert manager.plugins["half_way"].provides == {}


# -- name conflicts and overrides -------------------------------------------------------------------


def test_duplicate_name_without_override_names_both_distributions(root):
    sampler_distribution(root, "fw-dup-one", "dup_stage")
    sampler_distribution(root, "fw-dup-two", "dup_stage")
    with pytest.raises(DuplicatePluginNameError) as err:
        builtin_manager(root)
    message = str(err.value)
    assert "sampler 'dup_stage'" in message
    assert "fw-dup-one" in message and "fw-dup-two" in message
    assert "override=True" in message


def test_duplicate_of_a_builtin_without_override_fails(root):
    sampler_distribution(root, "fw-zz-topk", "top_k")
    with pytest.raises(DuplicatePluginNameError, match=r"'top_k'.*by fw \(plugin samplers\).*fw-zz-topk"):
        builtin_manager(root)


def test_override_is_accepted_and_shown(root, capsys):
    sampler_distribution(root, "fw-dup-one", "dup_stage")
    sampler_distribution(root, "fw-dup-two", "dup_stage", override=True)
    manager = builtin_manager(root)
    registration = manager.registry("sampler").registration("dup_stage")
    assert registration.distribution == "fw-dup-two"
    assert registration.overrides == ["fw-dup-one"]
    rows = {r["name"]: r for r in manager.inventory()}
    assert rows["fw_dup_two"]["overrides"] == {"sampler": ["dup_stage (from fw-dup-one)"]}
    assert rows["fw_dup_one"]["overrides"] == {}

    from fw.plugins.table import format_table

    assert "(overrides dup_stage (from fw-dup-one))" in format_table(manager.inventory())


def test_override_wins_whatever_the_load_order(root):
    """Plugins load sorted by distribution name; an override from a distribution that
    sorts before `fw` must still replace the built-in, not trip over it."""
    sampler_distribution(root, "aaa-fast-topk", "top_k", override=True)
    manager = builtin_manager(root)
    registration = manager.registry("sampler").registration("top_k")
    assert registration.distribution == "aaa-fast-topk"
    assert registration.overrides == ["fw"]
    rows = {r["name"]: r for r in manager.inventory()}
    assert rows["aaa_fast_topk"]["overrides"] == {"sampler": ["top_k (from fw)"]}
    assert manager.registry("sampler").get("top_k").order == 99


def test_two_distributions_with_the_same_plugin_name(root):
    sampler_distribution(root, "fw-same-a", "stage_a", plugin="same")
    sampler_distribution(root, "fw-same-b", "stage_b", plugin="same")
    manager = builtin_manager(root)
    assert "stage_a" in manager.registry("sampler")
    assert "stage_b" not in manager.registry("sampler")
    clash = manager.plugins["same@fw-same-b"]
    assert "'same' is also used by fw-same-a" in clash.error


# -- FW_PLUGINS / FW_DISABLE_PLUGINS ----------------------------------------------------------------


def test_allow_and_block_lists(example_site, monkeypatch, capsys):
    from fw.cli.main import main

    monkeypatch.syspath_prepend(str(example_site))

    rows: dict[str, dict] = {}

    def listed() -> set[str]:
        """The loaded plugins; disabled ones stay listed, as such."""
        reset_plugin_manager()
        assert main(["plugins", "list", "--json"]) == 0
        rows.clear()
        rows.update({r["name"]: r for r in json.loads(capsys.readouterr().out)["plugins"]})
        assert all(r["provides"] == {} for r in rows.values() if r["status"] == "disabled")
        return {name for name, r in rows.items() if r["status"] == "loaded"}

    builtin = {ep.name for ep in importlib.metadata.distribution("fw").entry_points if ep.group == "fw"}
    assert {"llama", "sdpa", "cpu_paged", "samplers"} <= builtin
    # other installed plugins (bootstrap installs the sampler plugins in plugins/)
    others = {ep.name for ep in importlib.metadata.entry_points(group="fw")} - builtin - {"example"}
    assert builtin | {"example"} <= listed()
    monkeypatch.setenv("FW_DISABLE_PLUGINS", "example")
    assert listed() == builtin | others
    assert rows["example"]["status"] == "disabled" and rows["example"]["distribution"] == "fw-example-plugin"
    monkeypatch.setenv("FW_DISABLE_PLUGINS", "fw-example-plugin, sdpa")  # distribution names work too
    assert listed() == (builtin | others) - {"sdpa"}
    monkeypatch.delenv("FW_DISABLE_PLUGINS")
    monkeypatch.setenv("FW_PLUGINS", "example,samplers")
    assert listed() == {"example", "samplers"}
    monkeypatch.setenv("FW_PLUGINS", "fw")  # a distribution: all of its plugins
    assert listed() == builtin
    monkeypatch.setenv("FW_DISABLE_PLUGINS", "llama")  # the block-list wins over the allow-list
    assert listed() == builtin - {"llama"}


# -- plugin API version -----------------------------------------------------------------------------


def test_newer_major_api_is_refused(root):
    sampler_distribution(root, "fw-future", "future_stage", api_version="2.0")
    manager = builtin_manager(root)
    info = manager.plugins["fw_future"]
    assert info.error == (
        f"refused: targets plugin API 2.0, but this fw provides {PLUGIN_API_VERSION}; "
        "install a version of the plugin built for API 1.x")
    assert "future_stage" not in manager.registry("sampler")
    assert "default" in manager.registry("sampler")
    with pytest.raises(PluginLoadError, match="refused: targets plugin API 2.0"):
        builtin_manager(root, strict=True)


def test_newer_minor_api_loads_with_a_warning(root):
    major, minor = PLUGIN_API_VERSION.split(".")
    later = f"{major}.{int(minor) + 1}"  # the next minor version, whatever this fw's is
    sampler_distribution(root, "fw-newer", "newer_stage", api_version=later)
    newer = r"fw-newer.*targets plugin API " + re.escape(later) + ", newer than this fw's " + re.escape(PLUGIN_API_VERSION)
    with pytest.warns(UserWarning, match=newer):
        manager = builtin_manager(root)
    info = manager.plugins["fw_newer"]
    assert info.error is None and info.api_version == later
    assert info.warnings == [f"targets plugin API {later}, newer than this fw's {PLUGIN_API_VERSION}; upgrade fw"]
    assert "newer_stage" in manager.registry("sampler")


@pytest.mark.parametrize("version, loads", [(None, True), ("1.0", True), ("0.9", False), ("one", False)])
def test_other_api_versions(root, version, loads):
    sampler_distribution(root, "fw-versioned", "versioned_stage", api_version=version)
    manager = builtin_manager(root)
    assert ("versioned_stage" in manager.registry("sampler")) is loads
    assert (manager.plugins["fw_versioned"].error is None) is loads


# -- the dependency rule --------------------------------------------------------------------------


def test_core_never_names_builtin_plugin_packages():
    """The core knows hook specs and registries only; built-in plugins enter through entry points."""
    core = Path(pf.REPO) / "core"
    pattern = re.compile(r"fw\.(architectures|backends|quantizers)\b")
    offenders = [
        f"{path.relative_to(pf.REPO)}:{number}: {line.strip()}"
        for path in sorted(core.rglob("*"))
        if path.is_file() and path.suffix in (".py", ".pyi", ".txt", ".toml", ".cfg", ".json", ".yaml")
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1)
        if pattern.search(line)
    ]
    assert not offenders, "core/ must not import built-in plugins by name:\n" + "\n".join(offenders)
    assert (core / "__init__.py").is_file()  # the scan looked at the real core


def test_public_plugin_api_is_what_the_example_plugin_imports():
    """The example plugin is written as an outside author would: fw.plugins, fw.layers
    and fw.sampling.batch only."""
    allowed = {"fw.plugins", "fw.layers", "fw.sampling.batch"}
    imported = set()
    for path in (pf.EXAMPLE_PLUGIN_SRC / "fw_example_plugin").glob("*.py"):
        imported |= set(re.findall(r"^\s*(?:from|import)\s+(fw(?:\.\w+)*)\b", path.read_text(), re.MULTILINE))
    assert imported and imported <= allowed, imported
    import fw.plugins

    for name in ("hookimpl", "ArchitectureSpec", "SamplerSpec", "AttentionBackendSpec", "PLUGIN_API_VERSION"):
        assert hasattr(fw.plugins, name)
    assert SamplerSpec("x", object).role == "stage"
