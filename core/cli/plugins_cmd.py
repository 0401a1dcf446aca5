"""`fw plugins list`: every plugin, its distribution, what it provides, and load errors."""

from __future__ import annotations

import argparse
import json

from fw.plugins.specs import KINDS

NAME = "plugins"
HELP = "Inspect installed plugins."


def configure(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="plugins_command", metavar="ACTION")
    ls = sub.add_parser("list", help="List plugins with what they provide and any load errors.")
    ls.add_argument("--json", action="store_true", help="Machine-readable output.")
    ls.add_argument("--kind", choices=KINDS, default=None, help="Only plugins providing this kind.")
    ls.add_argument("--custom-architectures", action="append", default=None,
                    help="Also load these custom architecture modules (as the engine would).")
    ls.add_argument("--strict-plugins", action="store_true", help="Exit non-zero if any plugin failed to load.")


def run(args: argparse.Namespace) -> int:
    from fw.plugins.manager import get_plugin_manager

    if args.plugins_command != "list":
        print("usage: fw plugins list [--json] [--kind KIND]")
        return 2
    manager = get_plugin_manager()
    if args.custom_architectures:
        manager.add_custom_architectures(args.custom_architectures)
    rows = manager.inventory(args.kind)
    if args.json:
        print(json.dumps({"plugins": rows}, indent=2))
    else:
        print(format_table(rows))
    return 0  # with --strict-plugins, `fw` has already exited non-zero if any plugin failed


def format_table(rows: list[dict]) -> str:
    header = ("PLUGIN", "DISTRIBUTION", "VERSION", "API", "STATUS", "PROVIDES")
    lines = [header]
    for r in rows:
        provides = "; ".join(f"{kind}: {', '.join(names)}" for kind, names in r["provides"].items() if names)
        if r["overrides"]:
            provides += " (overrides " + "; ".join(x for v in r["overrides"].values() for x in v) + ")"
        status = "error: " + r["error"] if r["error"] else r["status"]
        lines.append((r["name"], r["distribution"], r["version"], r["api_version"] or "-", status, provides or "-"))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header) - 1)]
    return "\n".join(
        "  ".join(str(c).ljust(w) for c, w in zip(line[:-1], widths)) + "  " + str(line[-1]) for line in lines
    )
