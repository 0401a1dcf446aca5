"""fw.plan: one place decides what the engine runs. A changed selection rule changes the engine,
`fw doctor` and `fw warm-cache` together; `fw doctor --json` prints the plan; `LLM.model_info`
is its summary; and no module outside fw.plan (and fw.plugins.selection's ranking) selects an
architecture, attention backend, quantization method or MoE kernel. Model: the tiny Llama of
tests/tiny_models.py."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from fw.cli.main import main
from fw.config import EngineConfig
from fw.plugins.specs import AttentionBackendSpec

pytestmark = pytest.mark.usefixtures("isolated_plugins")

CORE = Path(__file__).resolve().parent.parent / "core"


def doctor_report(capsys, *args: str) -> tuple[int, dict]:
    code = main(["doctor", "--json", *args])
    return code, json.loads(capsys.readouterr().out)


def warm_cache_choice(model: Path) -> str:
    """The attention backend `fw warm-cache` would warm for `model` (fw.warm.resolve, as its artifacts ask)."""
    from fw.model.source import local_source
    from fw.plugins.manager import engine_plugins
    from fw.warm import resolve
    from fw.warm.artifact import WarmContext

    config = EngineConfig(model=str(model), device="cpu", dtype="float32")
    context = WarmContext(config=config, plugins=engine_plugins(config), source=local_source(str(model)))
    return resolve.attention_backend(context)


def test_a_changed_selection_rule_changes_engine_doctor_and_warm_cache_together(capsys, monkeypatch, gqa_dir):
    from fw import LLM

    code, before = doctor_report(capsys, "--model", str(gqa_dir), "--device", "cpu", "--dtype", "float32")
    assert code == 0, before["problems"]
    default = before["selections"]["attention_backend"]["chosen"]
    assert warm_cache_choice(gqa_dir) == default
    boosted = "sdpa" if default != "sdpa" else "flex"

    # The rule: an attention backend's priority on a device. Raise one backend's above every other.
    priority_on = AttentionBackendSpec.priority_on
    monkeypatch.setattr(AttentionBackendSpec, "priority_on",
                        lambda self, device: 1000 if self.name == boosted else priority_on(self, device))

    code, after = doctor_report(capsys, "--model", str(gqa_dir), "--device", "cpu", "--dtype", "float32")
    assert code == 0, after["problems"]
    attention = after["selections"]["attention_backend"]
    assert attention["chosen"] == boosted
    assert {r["name"]: r for r in attention["candidates"]}[default]["note"] == f"lower priority than {boosted}"
    assert warm_cache_choice(gqa_dir) == boosted
    llm = LLM(model=str(gqa_dir), device="cpu", dtype="float32", num_kv_blocks=16)
    assert llm.engine.loaded.attention.chosen.name == boosted
    info = llm.model_info
    assert (info["architecture"], info["plugin"], info["distribution"]) == ("llama", "llama", "fw")
    assert info["attention_backend"] == boosted and info["quantization"] is None
    assert info["hf_architectures"] == ["LlamaForCausalLM"] and info["task"] == "generate"
    assert (info["device"], info["dtype"], info["kv_cache_dtype"]) == ("cpu", "float32", "float32")
    assert info == {**after["plan"]["summary"], "task": "generate"}  # doctor printed the engine's plan


def test_doctor_json_prints_the_plan(capsys, gqa_dir):
    code, report = doctor_report(capsys, "--model", str(gqa_dir), "--device", "cpu", "--attention-backend",
                                 "flash-attn")
    assert code == 1
    plan = report["plan"]
    assert plan["summary"]["architecture"] == "llama" and plan["summary"]["attention_backend"] is None
    attention = plan["decisions"]["attention_backend"]
    assert attention["option"] == "attention_backend" and attention["requested"] == "flash-attn"
    rows = {r["name"]: r for r in attention["candidates"]}
    assert rows["flash-attn"]["status"] == "rejected"
    assert rows["flash-attn"]["reasons"][0] == "device 'cpu' not supported (supports cuda)"
    assert attention["candidates"] == report["selections"]["attention_backend"]["candidates"]
    arch = plan["decisions"]["architecture"]
    assert arch["chosen"] == "llama" and {r["name"]: r for r in arch["candidates"]}["gemma"]["status"] == "rejected"
    [problem] = plan["problems"]
    assert problem["decision"] == "attention_backend" and problem["error"] == "UnsupportedConfigurationError"
    assert report["problems"] == [problem["message"]]
    assert plan["resolved"]["max_length"]["by"] == "model"
    for name in ("device", "dtype", "max_length", "kv_cache_dtype", "quantization_method", "moe_kernel"):
        assert name in plan["decisions"], name


def test_the_engine_raises_the_plans_first_problem(gqa_dir):
    from fw import LLM
    from fw.errors import UnsupportedConfigurationError
    from fw.plan import resolve
    from fw.plugins.manager import get_plugin_manager

    config = EngineConfig(model=str(gqa_dir), device="cpu", attention_backend="flash-attn", max_length=10**6)
    plan = resolve(config, get_plugin_manager(), tokenizer=False)
    assert [p.decision for p in plan.problems] == ["max_length", "attention_backend"]
    with pytest.raises(type(plan.problems[0].error), match="exceeds the model's context length"):
        LLM(model=str(gqa_dir), device="cpu", attention_backend="flash-attn", max_length=10**6)
    with pytest.raises(UnsupportedConfigurationError) as err:
        LLM(model=str(gqa_dir), device="cpu", attention_backend="flash-attn")
    assert str(err.value) == plan.problems[1].message
    assert str(err.value).endswith("Without --attention-backend, auto would choose "
                                   f"{plan.decision('attention_backend').details['auto_choice']}.")
    early = resolve(config, get_plugin_manager(), tokenizer=False, until="architecture")  # the factory's look
    assert early.architecture.name == "llama" and not early.problems and early.attention is None
    assert early.decision("attention_backend").skipped == "not resolved (until=architecture)"
    text = str(plan)  # printable: each decision, the rejected candidates and why
    assert "  architecture: llama" in text and "rejected flash-attn: device 'cpu' not supported" in text


# -- nothing else selects ---------------------------------------------------------------------------------

# The selections fw.plan makes; a call to one of them elsewhere would be a second place deciding.
SELECTIONS = {"select_attention_backend", "select_moe_kernel", "MoeKernelChooser", "find_architecture",
              "choose_quantization", "quantization_config", "attention_requirements", "resolve_dtype",
              "gguf_dequantizes_at_load", "selection_rank", "priority_on", "detects", "rejection_reason",
              "rejection_reasons", "architectures_in_order"}
# Per-request choices outside the engine plan, by design: grammar backends per constraint kind and the
# tool-call parser per chat template (the server's; doctor shows them with the same functions).
ALLOWED = {
    "plan/resolver.py": SELECTIONS, "plan/rules.py": SELECTIONS, "plugins/selection.py": SELECTIONS,
    "server/tools/plan.py": {"detects"}, "commands/doctor/checks.py": {"detects", "rejection_reasons"},
    "plugins/specs.py": {"rejection_reason", "rejection_reasons", "priority_on"},  # the specs' own checks
    # the conformance kit and the kernel bench judge the one spec they were asked about
    "testing/attention.py": {"rejection_reasons"}, "testing/moe.py": {"rejection_reasons"},
    "commands/bench/kernels.py": {"rejection_reasons"},
}


def _calls(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            func = node.func
            names.add(func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else "")
    return names


def test_no_selection_outside_the_plan():
    offenders = {}
    for path in sorted(CORE.rglob("*.py")):
        rel = path.relative_to(CORE).as_posix()
        found = (_calls(path) & SELECTIONS) - ALLOWED.get(rel, set())
        if found:
            offenders[rel] = sorted(found)
    assert not offenders, f"selections outside fw.plan (route them through fw.plan.resolve): {offenders}"
