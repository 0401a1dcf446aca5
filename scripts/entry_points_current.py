"""Exit 0 when the installed fw's plugin entry points are pyproject.toml's, 1 when they differ.

An editable install records its entry points (the `[project.entry-points.fw]` table: every built-in
plugin) when it is installed; a plugin added to the table later is not found until fw is installed
again. scripts/bootstrap.sh reinstalls when this says so. Every `fw` distribution visible from the
checkout's root counts (pytest, run from there, also sees a `fw.egg-info` left by setuptools)."""

from __future__ import annotations

import importlib.metadata
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["fw"]
    sys.path.insert(0, str(ROOT))
    found = [d for d in importlib.metadata.distributions() if (d.metadata["Name"] or "").lower() == "fw"]
    for dist in found:
        installed = {ep.name: ep.value for ep in dist.entry_points if ep.group == "fw"}
        if installed != declared:
            missing = sorted(set(declared) - set(installed))
            print(f"fw's installed entry points differ from pyproject.toml's (missing: {', '.join(missing) or '-'})")
            return 1
    return 0 if found else 1


if __name__ == "__main__":
    sys.exit(main())
