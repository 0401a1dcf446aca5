"""Template files (package data of fw.commands.scaffold) rendered with string.Template.

`$$name` placeholders, not Jinja: the templates are Python and Markdown full of braces, and a
template that leaves a placeholder unfilled fails here (`substitute`, not `safe_substitute`)
instead of writing a broken package."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from string import Template


def read_template(relative: str) -> str:
    return resources.files("fw.commands.scaffold").joinpath("templates", *relative.split("/")).read_text(encoding="utf-8")


def render(relative: str, values: dict[str, str]) -> str:
    try:
        return Template(read_template(relative)).substitute(values)
    except (KeyError, ValueError) as exc:  # a bug in fw's templates, not the user's input
        raise RuntimeError(f"fw.commands.scaffold template {relative}: {exc!r}") from exc


def write_files(root: Path, files: dict[str, str]) -> list[Path]:
    """Write `files` (relative path -> text) under `root`, creating directories; returns the paths."""
    written = []
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written
