"""`fw plugins list` from a record of the last full listing, while nothing it was made from has changed.

Why: a full listing imports every plugin module, and the built-in ones import torch: seconds for a
table. The record keeps the listing's rows with what they were made from: the `fw` entry points
(distribution, version, name, target), the FW_* variables (FW_PLUGINS and FW_DISABLE_PLUGINS decide what
loads), the interpreter and sys.path, and the size and modification time of every module file the
listing process had imported and of each entry point's own module file, with the modification times of
the folders they lie in and of sys.path's folders (installing, removing or adding a module changes a
folder's). The rows of plugins that failed are not taken on trust: each failed plugin is loaded again
on its own, and the record is used only if it fails the same way, so a fixed plugin shows as fixed.
Anything else that differs, and the listing is made again by loading every plugin, then recorded.
`--custom-architectures` and FW_TRACE_PLUGINS always load (docs/cli.md#listing-plugins-without-loading-them).
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

from fw import env
from fw.paths import cache_dir
from fw.plugins.hookspecs import ENTRY_POINT_GROUP
from fw.plugins.manager import PluginManager, distribution_of
from fw.version import __version__

FORMAT = 1
# FW_* variables that cannot change what a listing shows (strictness is applied to the rows afterwards)
_IGNORED_ENV = frozenset({env.CACHE_DIR.name, env.STRICT_PLUGINS.name})
# errors that follow from the entry points and recorded files alone: no need to load the plugin again
_SETTLED_ERRORS = ("refused: ", "plugin name ")


def record_path() -> Path:
    return cache_dir() / "plugins" / "listing.json"


def _entry_points() -> list[md.EntryPoint]:
    return sorted(md.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: (distribution_of(e)[0], e.name))


def _describe(ep: md.EntryPoint) -> list[str]:
    return [*distribution_of(ep), ep.name, ep.value]


def _key(eps: list[md.EntryPoint]) -> str:
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith("FW_") and k not in _IGNORED_ENV)
    cwd = os.getcwd() if "" in sys.path else None  # `python -c` imports from the working folder
    parts = [FORMAT, __version__, sys.version, sys.executable, sys.path, cwd, env, [_describe(ep) for ep in eps]]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def _stamp(path: str) -> list[int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]


def _module_origin(module: str) -> str | None:
    """The file an entry point's module would be imported from (a module that failed to import is in no
    list of loaded modules, and an edit to it must still count)."""
    try:
        spec = importlib.util.find_spec(module.split(":", 1)[0].strip())
    except Exception:  # its package is missing or broken: the folders' times cover a fix
        return None
    return spec.origin if spec is not None and spec.has_location else None


def _watched_files(eps: list[md.EntryPoint]) -> tuple[dict[str, list[int] | None], dict[str, list[int] | None]]:
    """(file -> [size, mtime_ns], folder -> [size, mtime_ns]) of what a listing made now depends on."""
    files = {m.__file__ for m in list(sys.modules.values()) if isinstance(getattr(m, "__file__", None), str)}
    files.update(o for o in (_module_origin(ep.value) for ep in eps) if o)
    folders = {os.path.dirname(f) for f in files} | {p or os.getcwd() for p in sys.path}
    return {f: _stamp(f) for f in sorted(files)}, {d: _stamp(d) for d in sorted(folders)}


def record(rows: list[dict], served: dict[str, list[str]], notes: str = "") -> None:
    """Record a full listing (`rows` as PluginManager.inventory() gives them; `served`: each architecture's
    Hugging Face class names; `notes`: what the plugins printed on the way). A record that cannot be
    written is skipped: it only saves time."""
    eps = _entry_points()
    files, folders = _watched_files(eps)
    data = {"key": _key(eps), "files": files, "folders": folders, "rows": rows, "served": served, "notes": notes}
    target = record_path()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".listing-")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, target)  # a concurrent reader sees the old record or the new one, never half
    except OSError:
        return


def recorded() -> tuple[list[dict], dict[str, list[str]], str] | None:
    """(rows, served, notes) of the recorded listing if it still holds, else None (then load the plugins)."""
    if env.TRACE_PLUGINS.get():
        return None
    try:
        data = json.loads(record_path().read_text())
    except (OSError, ValueError):
        return None
    eps = _entry_points()
    if not isinstance(data, dict) or data.get("key") != _key(eps):
        return None
    for stamps in (data["files"], data["folders"]):
        if any(_stamp(path) != stamp for path, stamp in stamps.items()):
            return None
    if not _failures_hold(data["rows"], eps):
        return None
    return data["rows"], data["served"], data["notes"]


def _failures_hold(rows: list[dict], eps: list[md.EntryPoint]) -> bool:
    """Each recorded failure, loaded again on its own, fails with the same row."""
    by_id = {(row["distribution"], row["name"], row["module"]): row for row in rows}
    for ep in eps:
        row = by_id.get((_describe(ep)[0], ep.name, ep.value))
        if row is None or not row["error"] or row["error"].startswith(_SETTLED_ERRORS):
            continue
        again = PluginManager(strict=False, entry_points=[ep], trace=False).load().inventory()
        if again != [row]:
            return False
    return True
