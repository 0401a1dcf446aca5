"""`fw plugins new --example NAME`: write out one of fw's example plugin packages.

The docs point plugin authors at real, tested packages (`plugins/` in fw's repository: a research
architecture, a sampler and an architecture override, two per-request samplers). A pip install has
no repository, so the wheel carries their sources as package data of fw.commands.scaffold (`examples/` is a
link to `plugins/` in the checkout) and this writes one out, tests included."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from fw.errors import ConfigError

# what each example shows (the names are the directories under plugins/)
EXAMPLES = {
    "fw-example-arch": "a research architecture transformers lacks: its config class, model and reference tests",
    "fw-example-plugin": "an always-on sampler stage and an architecture override, in one package",
    "fw-sampler-dry": "a per-request sampler with a parameter schema and `prepare` (DRY)",
    "fw-sampler-xtc": "a per-request sampler drawing from the row's generator (XTC)",
}
SUFFIXES = (".py", ".md", ".toml")  # what the wheel ships of them (pyproject's package-data for fw.commands.scaffold)


def example_files(name: str) -> dict[str, str]:
    """The example's files (relative path -> text), as shipped."""
    if name not in EXAMPLES:
        raise ConfigError(f"no example plugin named {name!r}; examples: "
                          + "; ".join(f"{n} ({what})" for n, what in EXAMPLES.items()))
    root = resources.files("fw.commands.scaffold").joinpath("examples", name)
    files: dict[str, str] = {}
    stack = [(root, "")]
    while stack:
        node, relative = stack.pop()
        for child in node.iterdir():
            path = f"{relative}{child.name}"
            if child.is_dir():
                if child.name != "__pycache__" and not child.name.endswith(".egg-info"):
                    stack.append((child, path + "/"))
            elif child.name.endswith(SUFFIXES):
                files[path] = child.read_text(encoding="utf-8")
    if not files:
        raise ConfigError(f"example {name!r} is not in this installation of fw (its package data is missing)")
    return files


def write_example(name: str, output_dir: str | Path = ".") -> Path:
    """Write example `name` to `output_dir/name`; return that directory."""
    from fw.commands.scaffold.render import write_files

    files = example_files(name)
    output = Path(output_dir)
    if output.exists() and not output.is_dir():
        raise ConfigError(f"--output {str(output)!r} is a file, not a directory")
    root = output / name
    if root.exists():
        raise ConfigError(f"{str(root)!r} already exists; choose another --output directory, or remove it first")
    write_files(root, files)
    return root
