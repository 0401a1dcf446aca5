"""fw's import graph, read from the source (scripts/import_graph.py; nothing is imported): no module
imports another that imports it back, even through imports inside functions (a circle hidden in a
function is still a circle); the inference core never imports the tooling at module level; an import
inside a function says why (start-up time) in a comment; docs/architecture.md shows the graph as it is."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import import_graph  # noqa: E402  (scripts/import_graph.py)

EDGES, LOCAL = import_graph.scan()

# The tooling: commands and kits around the engine that serving never needs. The inference core is every
# other fw module except the command line and the built-in plugins (tests/test_plugin_imports.py holds those
# to the plugin API).
TOOLING = (
    "fw.commands",  # fw bench, fw doctor, fw warm-cache, fw plugins new, the flag reference, the API snapshot
    "fw.testing",  # the conformance kit
    # the ready-made warm-cache artifacts and what the server would pick for them: plugin API (fw.warm), run
    # only by fw warm-cache (fw.warm.startup, the start-up report, and fw.warm.artifact, the contract, are core)
    "fw.warm.cpp", "fw.warm.grammar", "fw.warm.resolve",
)
PLUGINS = ("fw.architectures", "fw.backends", "fw.quantizers")
FRONTS = ("fw.cli",)  # the command line runs the commands: it may import them (lazily: `fw --help` stays light)


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _where(a: str, b: str) -> str:
    edge = next(e for e in EDGES if e.source == a and e.target == b)
    return f"{edge.path}:{edge.line}" + (" (in a function)" if edge.local else "")


def test_no_import_circle():
    loops = import_graph.circles(import_graph.graph(EDGES))
    text = ["  " + " -> ".join(loop) + "\n" + "\n".join(f"    {a} -> {b}: {_where(a, b)}"
                                                          for a, b in zip(loop, loop[1:])) for loop in loops]
    assert not loops, ("import circles (break each by moving the shared piece to the lower module or passing it "
                       "in, not by hiding the import in a function):\n" + "\n".join(text))


def test_the_circle_check_sees_a_circle():
    g = {"fw.a": {"fw.b"}, "fw.b": {"fw.c"}, "fw.c": {"fw.a"}, "fw.d": {"fw.a"}}
    assert import_graph.circles(g) == [["fw.a", "fw.b", "fw.c", "fw.a"]]
    assert import_graph.circles({"fw.a": {"fw.b"}, "fw.b": set()}) == []


def test_the_scan_reads_every_kind_of_import(tmp_path):
    core = tmp_path / "core"
    (core / "engine").mkdir(parents=True)
    (core / "__init__.py").write_text("")
    (core / "engine" / "__init__.py").write_text("from . import step\nfrom .step import run\n")
    (core / "engine" / "step.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fw.llm import LLM\n"
        "try:\n    import fw.config\nexcept ImportError:\n    pass\n\n\ndef run():\n"
        "    import torch  # here: torch costs start-up time\n    from fw.llm import LLM\n    x = 1\n"
        "    # here: one comment above a block of imports speaks for it\n    import json\n    import re\n")
    (core / "config.py").write_text("")
    (core / "llm.py").write_text("from fw.engine.step import run\n")
    edges, local = import_graph.scan(tmp_path)
    found = {(e.source, e.target, e.local) for e in edges}
    assert found == {("fw.engine", "fw.engine.step", False), ("fw.engine.step", "fw.config", False),
                     ("fw.engine.step", "fw.llm", True), ("fw.llm", "fw.engine.step", False)}
    assert [(i.line, i.commented) for i in local] == [(11, True), (12, False), (15, True), (16, True)]
    assert import_graph.circles(import_graph.graph(edges)) == [["fw.engine.step", "fw.llm", "fw.engine.step"]]
    assert import_graph.circles(import_graph.graph(edges, local=False)) == []


def _core_to_tooling(edges) -> list[str]:
    """Edges from the inference core into the tooling or the command line."""
    return [f"{e.source} -> {e.target}: {e.path}:{e.line}" for e in edges
            if not _within(e.source, TOOLING + PLUGINS + FRONTS) and _within(e.target, TOOLING + FRONTS)]


def test_the_inference_core_never_imports_the_tooling():
    known = import_graph.modules()
    assert all(any(m == t or m.startswith(t + ".") for m in known) for t in TOOLING), "a tooling module was renamed"
    found = _core_to_tooling(EDGES)
    assert not found, ("the inference core imports tooling (bench, scaffold, testing, warm-cache, API snapshot, "
                       "flag reference) or the command line; have the tool call the core instead:\n" + "\n".join(found))


def test_the_tooling_check_sees_a_violation():
    edge = import_graph.Import
    assert _core_to_tooling([edge("fw.engine.engine", "fw.commands.bench.report", "a.py", 1, True),
                             edge("fw.server.app", "fw.cli.main", "b.py", 2, False),
                             edge("fw.cli.main", "fw.commands.bench", "d.py", 4, False),  # the command line may
                             edge("fw.commands.warm_cache.runner", "fw.engine.engine", "e.py", 5, False)]) == [
        "fw.engine.engine -> fw.commands.bench.report: a.py:1", "fw.server.app -> fw.cli.main: b.py:2"]


def _silent(local) -> list[str]:
    """The function-local imports with no comment saying why."""
    return [f"{imp.path}:{imp.line}: {imp.text}" for imp in local if not imp.commented]


def test_function_local_imports_say_why():
    silent = _silent(LOCAL)
    assert not silent, ("an import inside a function is allowed where start-up time needs it, with a comment "
                        "saying so (on its line, or above it or its block of imports); else move it to the top of the "
                        "module:\n"
                        + "\n".join(silent))


def test_the_say_why_check_sees_a_silent_import(tmp_path):
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "__init__.py").write_text("")
    (tmp_path / "core" / "tool.py").write_text(
        "def run():\n    import json  # here: a reason\n    import torch\n\n    import re\n")
    assert _silent(import_graph.scan(tmp_path)[1]) == ["core/tool.py:3: import torch", "core/tool.py:5: import re"]


def test_the_docs_show_the_graph_as_it_is():
    doc = import_graph.DOC.read_text(encoding="utf-8")
    assert import_graph.section(doc, "graph") == import_graph.render_graph(EDGES), (
        "docs/architecture.md's import graph is out of date: run python scripts/import_graph.py --write")
    listed = {line.split("`")[1] for line in import_graph.section(doc, "layout").splitlines()
              if line.startswith("| `")}
    assert listed == set(import_graph.line_counts()), (
        "docs/architecture.md's layout table lists other packages: run python scripts/import_graph.py --write")
