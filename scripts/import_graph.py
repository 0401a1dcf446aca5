"""fw's import graph, read from the source with `ast` (nothing is imported, so it costs no torch).

Why a script: tests/test_import_graph.py checks the graph (no circles, the inference core never
imports the tooling, function-local imports say why) and docs/architecture.md shows it; both read
it from here, so the picture in the docs is the one the test checks.

    python scripts/import_graph.py            # print the docs' generated sections (layout, graph)
    python scripts/import_graph.py --write    # rewrite them in docs/architecture.md
    python scripts/import_graph.py --check    # exit 1 when the docs' graph is out of date (line counts may drift)

An edge A -> B means module A's source imports fw module B: at module level (under `if`/`try` too,
not under `if TYPE_CHECKING`) or inside a function (`Import.local`). `from pkg import name` is an
edge to `pkg.name` when that is a module, else to `pkg`.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# source directory -> import name (pyproject.toml's package-dir)
SOURCES = {"core": "fw", "architectures": "fw.architectures", "backends": "fw.backends",
           "quantizers": "fw.quantizers"}
SKIP = ("core/commands/scaffold/templates", "core/commands/scaffold/examples")  # files `fw plugins new` writes out, not fw's modules
DOC = ROOT / "docs" / "architecture.md"


@dataclass(frozen=True)
class Import:
    """One import statement's edge: `source` imports the fw module `target` at `path:line`."""

    source: str
    target: str
    path: str
    line: int
    local: bool  # inside a function (runs when the function does)


@dataclass(frozen=True)
class LocalImport:
    """An import statement inside a function, fw's or a library's, with whether a comment says why."""

    module: str
    path: str
    line: int
    text: str
    commented: bool


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every fw module name -> its file."""
    out = {}
    for folder, name in SOURCES.items():
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel.startswith(SKIP):
                continue
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([name, *parts])] = path
    return out


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _statements(body: list[ast.stmt], local: bool):
    """(import statement, inside a function?) for every import in `body`, skipping TYPE_CHECKING blocks."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, local
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _statements(node.body, True)
        elif isinstance(node, ast.If) and _type_checking(node):
            yield from _statements(node.orelse, local)
        else:
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                children = getattr(node, field, None)
                if isinstance(children, list):
                    yield from _statements([c for c in children if isinstance(c, ast.AST)], local)


def imported(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[tuple[str, str | None]]:
    """(module, name) pairs one import statement names: `import a.b` -> (a.b, None); `from .x import y`
    in package p -> (p.x, y), relative imports resolved against the importing module's package."""
    if isinstance(node, ast.Import):
        return [(alias.name, None) for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: from the importing module's package
        package = module if is_package else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    return [(base, alias.name) for alias in node.names]


def _names(module: str, is_package: bool, node: ast.Import | ast.ImportFrom, known: dict[str, Path]) -> list[str]:
    """The modules a statement imports: `from pkg import name` is `pkg.name` when that is a module."""
    return [f"{base}.{name}" if name and f"{base}.{name}" in known else base
            for base, name in imported(module, is_package, node)]


def _owner(name: str, known: dict[str, Path]) -> str | None:
    """The fw module `name` lives in (`fw.layers.Linear` -> `fw.layers`), None outside fw."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _commented(lines: list[str], line: int) -> bool:
    """A comment on the import's line, or on the line just above it or above the run of import lines it
    belongs to (one comment may speak for a block of imports)."""
    if "#" in lines[line - 1]:
        return True
    above = line - 2
    while above >= 0 and lines[above].strip().startswith(("import ", "from ")):
        above -= 1
    return above >= 0 and lines[above].strip().startswith("#")


def scan(root: Path = ROOT) -> tuple[list[Import], list[LocalImport]]:
    """Every import of an fw module, and every function-local import statement."""
    known = modules(root)
    edges: list[Import] = []
    local: list[LocalImport] = []
    for module, path in known.items():
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        rel = path.relative_to(root).as_posix()
        for node, inside in _statements(ast.parse(text, rel).body, False):
            if inside:
                local.append(LocalImport(module, rel, node.lineno, lines[node.lineno - 1].strip(),
                                         _commented(lines, node.lineno)))
            for name in _names(module, path.name == "__init__.py", node, known):
                target = _owner(name, known) if name.split(".")[0] == "fw" else None
                if target and target != module:
                    edges.append(Import(module, target, rel, node.lineno, inside))
    return edges, local


def graph(edges: list[Import], local: bool = True) -> dict[str, set[str]]:
    """module -> the fw modules it imports (with function-local imports unless `local` is False)."""
    out: dict[str, set[str]] = defaultdict(set)
    for edge in edges:
        if local or not edge.local:
            out[edge.source].add(edge.target)
    return out


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected group of modules, as a path `[a, b, ..., a]` (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1 or v in g.get(v, ()):
                groups.append(group)

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for v in sorted(g):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return [_path_through(group, g) for group in groups]


def _path_through(group: set[str], g: dict[str, set[str]]) -> list[str]:
    """A shortest circle from the group's first module back to itself (breadth first)."""
    start = min(group)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(g.get(v, ()) & group):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start] if v != start else [start, start]
                if w not in parents:
                    parents[w] = v
                    nxt.append(w)
        frontier = nxt
    return sorted(group)


# -- packages: the picture in docs/architecture.md ------------------------------------------------


def package(module: str) -> str:
    """The package a module belongs to in the docs' picture: `fw.engine.scheduler` -> `fw.engine`,
    `fw.backends.attention.sdpa` -> `fw.backends.attention`; fw's root modules (`fw.config`, `fw.llm`,
    ...) stand for themselves."""
    parts = module.split(".")
    depth = 3 if parts[:2] == ["fw", "backends"] and len(parts) > 2 else 2
    return ".".join(parts[:depth])


def package_graph(edges: list[Import]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = defaultdict(set)
    for edge in edges:
        a, b = package(edge.source), package(edge.target)
        if a != b:
            out[a].add(b)
    return out


def mutual(edges: list[Import]) -> dict[tuple[str, str], tuple[str, str]]:
    """(package a, package b) that import each other -> one module edge a -> b and one b -> a."""
    first: dict[tuple[str, str], str] = {}
    for edge in sorted(edges, key=lambda e: (e.local, e.source, e.target)):  # module-level edges first
        key = (package(edge.source), package(edge.target))
        if key[0] != key[1]:
            first.setdefault(key, f"`{edge.source}` -> `{edge.target}`" + (" (in a function)" if edge.local else ""))
    return {(a, b): (first[(a, b)], first[(b, a)]) for (a, b) in sorted(first) if a < b and (b, a) in first}


def line_counts(root: Path = ROOT) -> dict[str, tuple[int, int]]:
    """package -> (modules, lines of Python)."""
    out: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for module, path in modules(root).items():
        count = out[package(module)]
        count[0] += 1
        count[1] += len(path.read_text(encoding="utf-8").splitlines())
    return {name: (m, n) for name, (m, n) in out.items()}


def _job(module: str, root: Path) -> str:
    """The first sentence of a package's (or root module's) docstring: its one job."""
    path = modules(root)[module]
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    first = " ".join(doc.split("\n\n")[0].split())
    return first.split(". ")[0].rstrip(".").replace("|", "\\|") if first else "(no docstring)"


def render_layout(root: Path = ROOT) -> str:
    """The layout table: each package with its modules, lines and one job."""
    counts = line_counts(root)
    rows = ["| package | modules | lines | its job (first sentence of its docstring) |", "|---|---:|---:|---|"]
    rows += [f"| `{name}` | {m} | {n:,} | {_job(name, root)} |" for name, (m, n) in sorted(counts.items())]
    rows.append(f"| all | {sum(m for m, _ in counts.values())} | {sum(n for _, n in counts.values()):,} | |")
    return "\n".join(rows) + "\n"


def foundation(packages: dict[str, set[str]]) -> set[str]:
    """The modules at the bottom: those that import no fw module outside this set (fw.errors, fw.version, ...)."""
    names = set(packages) | {b for targets in packages.values() for b in targets}
    base = {n for n in names if not packages.get(n)}
    while True:
        more = {n for n in names - base if packages.get(n, set()) <= base}
        if not more:
            return base
        base |= more


def render_graph(edges: list[Import]) -> str:
    """The package graph as text and as mermaid, and the packages that import each other."""
    packages = package_graph(edges)
    names = sorted({package(e.source) for e in edges} | {package(e.target) for e in edges})
    width = max(len(n) for n in names)
    base = foundation(packages)
    text = ["```", *[f"{name:<{width}} -> {', '.join(sorted(packages.get(name, ()))) or '-'}" for name in names],
            "```", "", f"The same as a diagram, without the edges into the modules everything builds on "
            f"({', '.join(f'`{b}`' for b in sorted(base))}: they import nothing but each other):", "",
            "```mermaid", "flowchart LR"]
    text += [f"  {a.replace('.', '_')}[{a}] --> {b.replace('.', '_')}[{b}]"
             for a in names if a not in base for b in sorted(packages.get(a, ())) if b not in base]
    text += ["```", ""]
    pairs = mutual(edges)
    if pairs:
        text += ["Packages that import each other. No module circle is among them (the test checks modules): "
                 "each pair holds a module that sits in the other package's folder, or beside it, until the "
                 "layout moves (issue 20, item 4). One module edge each way:", ""]
        text += [f"- `{a}` <-> `{b}`: {there} / {back}" for (a, b), (there, back) in pairs.items()]
    return "\n".join(text).rstrip() + "\n"


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}: generated by scripts/import_graph.py --write -->", f"<!-- end of {name} -->"


def section(doc: str, name: str) -> str:
    """The text between the markers of the generated section `name` ("layout" or "graph")."""
    begin, end = _markers(name)
    if begin not in doc or end not in doc:
        raise ValueError(f"{DOC}: the markers {begin!r} ... {end!r} are missing")
    return doc.split(begin, 1)[1].split(end, 1)[0].strip("\n") + "\n"


def replace_section(doc: str, name: str, text: str) -> str:
    begin, end = _markers(name)
    section(doc, name)  # both markers are there
    head, rest = doc.split(begin, 1)
    return f"{head}{begin}\n{text}{end}{rest.split(end, 1)[1]}"


def main(argv: list[str]) -> int:
    edges, _ = scan()
    parts = {"layout": render_layout(), "graph": render_graph(edges)}
    if "--write" not in argv and "--check" not in argv:
        print("\n".join(parts.values()), end="")
        return 0
    doc = DOC.read_text(encoding="utf-8")
    new = doc
    for name, text in parts.items():
        new = replace_section(new, name, text)
    if "--check" in argv:
        stale = section(doc, "graph") != parts["graph"]
        if stale:
            print(f"{DOC}: the import graph is out of date: run python scripts/import_graph.py --write")
        return int(stale)
    DOC.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
