"""`fw plugins list` from its recorded listing (fw.plugins.listing_record): the same table without importing
torch, while nothing it was made from changed; an edited plugin, a broken or fixed one, or another
FW_DISABLE_PLUGINS makes a fresh listing."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

import plugin_fixtures as pf
from fw.cli.main import main
from fw.plugins import manager as plugin_manager
from fw.plugins.manager import reset_plugin_manager

TORCH_AT_EXIT = ("import sys\nfrom fw.cli.main import main\ncode = main(['plugins', 'list', '--json'])\n"
                 "print('torch imported:', 'torch' in sys.modules, file=sys.stderr)\nsys.exit(code)")


def test_a_recorded_listing_is_the_same_and_imports_no_torch(tmp_path):
    env = pf.clean_env(FW_CACHE_DIR=str(tmp_path / "cache"))
    (tmp_path / "cwd").mkdir()  # `python -c` imports from its working folder: one nothing else writes to
    runs = [subprocess.run([sys.executable, "-c", TORCH_AT_EXIT], env=env, capture_output=True, text=True,
                           timeout=120, cwd=tmp_path / "cwd") for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr
    assert "torch imported: True" in runs[0].stderr  # the full listing imports the plugins, torch with them
    assert "torch imported: False" in runs[1].stderr
    assert json.loads(runs[1].stdout) == json.loads(runs[0].stdout)


@pytest.fixture
def full_loads(root, isolated_plugins, tmp_path_factory, monkeypatch) -> list[int]:
    """A fresh FW_CACHE_DIR; the list counts the listings made by loading every plugin."""
    monkeypatch.setenv("FW_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    calls: list[int] = []
    load = plugin_manager.PluginManager.load

    def counted(self):
        if self._entry_points is None:
            calls.append(1)
        return load(self)

    monkeypatch.setattr(plugin_manager.PluginManager, "load", counted)
    return calls


def listing(capsys, *flags: str) -> dict[str, dict]:
    reset_plugin_manager()
    assert main(["plugins", "list", "--json", *flags]) == 0
    return {row["name"]: row for row in json.loads(capsys.readouterr().out)["plugins"]}


def test_an_edited_plugin_is_listed_afresh(root, full_loads, capsys):
    module = pf.unique("fwtest_listed")
    pf.make_distribution(root, "fw-listed", {module: pf.sampler_plugin("stage_one")}, {"listed": module})
    assert listing(capsys)["listed"]["provides"] == {"sampler": ["stage_one"]}
    assert listing(capsys)["listed"]["provides"] == {"sampler": ["stage_one"]}
    assert len(full_loads) == 1  # the second came from the record
    (root / f"{module}.py").write_text(textwrap.dedent(pf.sampler_plugin("stage_two_renamed")))
    sys.modules.pop(module)  # as a new process would import it
    assert listing(capsys)["listed"]["provides"] == {"sampler": ["stage_two_renamed"]}
    assert len(full_loads) == 2


def test_a_broken_plugin_shows_its_error_from_the_record_until_it_is_fixed(root, full_loads, capsys):
    module = pf.unique("fwtest_broken")
    pf.make_distribution(root, "fw-broken-plugin", {module: pf.BROKEN_PLUGIN}, {"broken": module})
    for _ in range(2):
        row = listing(capsys)["broken"]
        assert row["status"] == "error" and "broken on purpose" in row["error"]
    assert len(full_loads) == 1
    reset_plugin_manager()
    assert main(["plugins", "list", "--strict-plugins"]) == 2
    assert "--strict-plugins" in capsys.readouterr().err
    assert len(full_loads) == 1
    (root / f"{module}.py").write_text(textwrap.dedent(pf.sampler_plugin("mended_stage")))
    row = listing(capsys)["broken"]
    assert row["status"] == "loaded" and row["provides"] == {"sampler": ["mended_stage"]}


def test_the_plugin_selection_variables_make_a_fresh_listing(root, full_loads, capsys, monkeypatch):
    assert listing(capsys)["sdpa"]["status"] == "loaded"
    monkeypatch.setenv("FW_DISABLE_PLUGINS", "sdpa")
    assert listing(capsys)["sdpa"]["status"] == "disabled"
    assert len(full_loads) == 2
    assert listing(capsys, "--kind", "architecture")["llama"]["hf_architectures"] == {
        "llama": ["LlamaForCausalLM", "MistralForCausalLM"]}
    assert len(full_loads) == 2
