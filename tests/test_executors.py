"""The executor plugin kind (--distributed-executor-backend): the built-ins (uni, mp, external_launcher)
come through the entry-point table, auto picks by vLLM's rule, a third-party executor installed as a
distribution starts the ranks when named, and a wrong name fails before any process starts, listing
what is installed. Each engine of two ranks spawns one worker (about 3 s)."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch.multiprocessing as mp

import plugin_fixtures as pf
from conftest import make_llm
from fw import SamplingParams
from fw.config import EngineConfig
from fw.errors import ConfigError
from fw.plan.rules import choose_executor
from fw.plugins import Executor, ExecutorSpec
from fw.testing import conformance_suite

RECORDING = '''
import torch.multiprocessing as mp

from fw.plugins import Executor, ExecutorSpec, hookimpl

FW_PLUGIN_API_VERSION = "1.10"
STARTED = []  # (ranks, addr) of each start_workers call: the test reads it


class RecordingExecutor(Executor):
    """Spawns the ranks like mp, and records that it did."""

    def start_workers(self, launch):
        context = mp.get_context("spawn")
        procs = {}
        for rank in launch.ranks:
            procs[rank] = context.Process(target=launch.target, args=launch.args(rank), daemon=True)
            procs[rank].start()
        STARTED.append((launch.ranks, launch.addr))
        return procs


@hookimpl
def fw_register_executors(register):
    register(ExecutorSpec("recording", RecordingExecutor, description="spawns like mp and records it"))
'''


class ForkingExecutor(Executor):
    """A test executor for the conformance kit: the ranks as spawned processes named after this test."""

    def start_workers(self, launch):
        context = mp.get_context("spawn")
        procs = {rank: context.Process(target=launch.target, args=launch.args(rank), name=f"kit-rank{rank}",
                                       daemon=True) for rank in launch.ranks}
        for proc in procs.values():
            proc.start()
        return procs


# the kit on a third-party spec, and on the built-ins (uni and external_launcher are skipped with the reason)
TestKitExecutor = conformance_suite("executor", ExecutorSpec("kit", ForkingExecutor))
TestUniExecutor = conformance_suite("executor", "uni")
TestExternalLauncherExecutor = conformance_suite("executor", "external_launcher")


def test_the_builtins_come_through_the_entry_points():
    manager = pf.builtin_manager()
    rows = {row["name"]: row for row in manager.inventory("executor") if row["provides"]["executor"]}
    assert {name: row["provides"]["executor"] for name, row in rows.items()} == {
        "uni": ["uni"], "mp": ["mp"], "external_launcher": ["external_launcher"]}
    assert all(row["distribution"] == "fw" for row in rows.values())


@pytest.mark.parametrize("tp, launched, named, chosen", [
    (1, False, "auto", "uni"), (2, False, "auto", "mp"), (1, True, "auto", "external_launcher"),
    (2, True, "auto", "external_launcher"), (1, False, "mp", "mp"), (2, True, "mp", "mp")])
def test_auto_follows_vllms_rule_and_a_name_wins(tp, launched, named, chosen):
    config = EngineConfig(tensor_parallel_size=tp, distributed_executor_backend=named)
    assert choose_executor(config, pf.builtin_manager(), launched).name == chosen


def test_one_process_runs_without_any_executor_installed(gqa_dir):
    """auto at one rank starts nothing, so plugins that leave the executors out (FW_PLUGINS) still serve."""
    from fw.plugins.manager import PluginManager

    eps = [ep for ep in pf.fw_entry_points() if not ep.value.startswith("fw.backends.executors.")]
    plugins = PluginManager(entry_points=eps).load()
    assert len(plugins.registry("executor")) == 0
    llm = make_llm(gqa_dir, plugins=plugins)
    assert llm.engine.cluster is None
    assert len(llm.generate(["Hello"], SamplingParams(max_tokens=2, ignore_eos=True))[0].outputs[0].token_ids) == 2


def test_an_unknown_executor_is_refused_listing_the_installed_ones(gqa_dir):
    with pytest.raises(ConfigError, match=r"--distributed-executor-backend ray: no executor of that name is "
                                          r"installed; installed: external_launcher, mp, uni"):
        make_llm(gqa_dir, distributed_executor_backend="ray")


def test_uni_refuses_two_ranks_naming_the_executors_that_can(gqa_dir):
    with pytest.raises(ConfigError, match=r"--distributed-executor-backend uni cannot run --tensor-parallel-size 2 "
                                          r"over --nnodes 1: it runs at most 1 rank; executors that can: "
                                          r"external_launcher, mp"):
        make_llm(gqa_dir, tensor_parallel_size=2, distributed_executor_backend="uni")


def test_external_launcher_without_a_launcher_says_how_to_start_it(gqa_dir, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match=r"external_launcher: no launcher started this process .* start it with "
                                          r"torchrun, or use mp"):
        make_llm(gqa_dir, tensor_parallel_size=2, distributed_executor_backend="external_launcher")


def test_a_third_party_executor_named_by_the_flag_starts_the_ranks(gqa_dir, tmp_path, monkeypatch):
    module = pf.unique("fwtest_executor")
    root = pf.make_distribution(tmp_path / "site", "fw-executor-recording", {module: RECORDING},
                                {"recording": module})
    monkeypatch.syspath_prepend(str(root))
    plugins = pf.builtin_manager(root)
    assert "recording" in plugins.registry("executor")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = ["Hello world", "The engine schedules every request in pages"]
    want = [o.outputs[0].token_ids for o in make_llm(gqa_dir, plugins=plugins).generate(prompts, params)]
    llm = make_llm(gqa_dir, plugins=plugins, tensor_parallel_size=2, distributed_executor_backend="recording")
    try:
        started = importlib.import_module(module).STARTED
        assert started == [((1,), llm.engine.cluster.addr)]
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    finally:
        procs = list(llm.engine.cluster.procs.values())
        llm.engine.cluster.close()
        sys.modules.pop(module, None)
    assert [p.exitcode for p in procs] == [0]


def test_the_command_line_lists_a_third_party_executor_and_refuses_an_unknown_name(gqa_dir, tmp_path):
    module = pf.unique("fwtest_executor")
    root = pf.make_distribution(tmp_path / "site", "fw-executor-recording", {module: RECORDING},
                                {"recording": module})
    rows = pf.plugins_json(pf.run_fw("plugins", "list", "--kind", "executor", "--json", pythonpath=[root]))
    assert rows["recording"]["distribution"] == "fw-executor-recording"
    assert rows["recording"]["provides"] == {"executor": ["recording"]} and rows["mp"]["distribution"] == "fw"
    proc = pf.run_fw("generate", "--model", str(gqa_dir), "--prompt", "hi", "--distributed-executor-backend", "ray",
                     pythonpath=[root])
    assert proc.returncode != 0
    assert ("--distributed-executor-backend ray: no executor of that name is installed; installed: "
            "external_launcher, mp, recording, uni") in proc.stderr
