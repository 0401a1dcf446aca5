"""pyproject.toml lists its packages by hand (the directories map onto `fw.*`),
so a new package directory must be listed or `pip install .` ships without it."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_directory_is_listed() -> None:
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setup["packages"])
    found = set()
    for package, directory in setup["package-dir"].items():
        base = ROOT / directory
        for init in base.rglob("__init__.py"):
            relative = init.parent.relative_to(base)
            found.add(".".join([package, *relative.parts]))
    assert found - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    assert listed - found == set(), "these listed packages have no directory with __init__.py"


def test_every_cpp_source_and_header_is_package_data() -> None:
    """C++ ops are compiled on the user's machine from files shipped in the wheel: each .cpp/.h under a
    package directory must match a `package-data` pattern of its package."""
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir = {package: ROOT / directory for package, directory in setup["package-dir"].items()}
    data = setup["package-data"]
    missing = []
    for base_package, base in package_dir.items():
        for source in [*base.rglob("*.cpp"), *base.rglob("*.h")]:
            parts = source.parent.relative_to(base).parts
            # the innermost listed package that contains the file, and the file's path relative to it
            for depth in range(len(parts), -1, -1):
                package = ".".join([base_package, *parts[:depth]])
                if package in setup["packages"]:
                    relative = Path(*parts[depth:], source.name)
                    break
            if not any(relative.match(pattern) for pattern in data.get(package, [])):
                missing.append(f"{source.relative_to(ROOT)} (package {package}, as {relative})")
    assert not missing, f"add to [tool.setuptools] package-data: {missing}"
