"""The per-request sampler plugins in plugins/ (DRY, XTC) for the library and server tests: a
plugin manager over fw's own entry points plus theirs, whether or not they are installed (from
the checkout when not), and the request checks the tests share."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PLUGINS = {"dry": ("fw-sampler-dry", "fw_sampler_dry"), "xtc": ("fw-sampler-xtc", "fw_sampler_xtc")}


def sampler_plugin_entry_points() -> list[md.EntryPoint]:
    eps = []
    for name, (dist, package) in PLUGINS.items():
        try:
            eps += [ep for ep in md.distribution(dist).entry_points if ep.group == "fw"]
        except md.PackageNotFoundError:
            if importlib.util.find_spec(package) is None:
                sys.path.insert(0, str(REPO / "plugins" / dist))
            eps.append(md.EntryPoint(name=name, value=f"{package}.plugin", group="fw"))
    return eps


def manager_with_sampler_plugins():
    """fw's built-in plugins and the DRY and XTC plugins, whatever FW_PLUGINS says."""
    from fw.plugins.manager import PluginManager

    eps = [ep for ep in md.distribution("fw").entry_points if ep.group == "fw"] + sampler_plugin_entry_points()
    return PluginManager(entry_points=eps, allow={ep.name for ep in eps}, block=()).load()


def repeated_trigrams(ids: list[int]) -> int:
    """How many 3-token windows of `ids` appeared earlier in it."""
    seen, repeats = set(), 0
    for i in range(2, len(ids)):
        window = tuple(ids[i - 2:i + 1])
        repeats += window in seen
        seen.add(window)
    return repeats
