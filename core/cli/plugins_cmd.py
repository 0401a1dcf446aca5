"""`fw plugins list`: every plugin, its distribution, what it provides, and load errors.
`fw plugins new`: write a working plugin package to start from (fw.commands.scaffold)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import warnings
from typing import Any, Callable

from fw import env
from fw.plugins.specs import KINDS
from fw.plugins.table import format_table

# `fw plugins new --kind` values (fw.commands.scaffold.KINDS, listed here so building the parser stays import-light)
SCAFFOLD_KINDS = ("architecture", "attention", "quantization", "sampler", "grammar")

NAME = "plugins"
HELP = "Inspect installed plugins, or start a new one."


def configure(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="plugins_command", metavar="ACTION")
    ls = sub.add_parser("list", help="List plugins with what they provide and any load errors.")
    ls.add_argument("--json", action="store_true", help="Machine-readable output.")
    ls.add_argument("--kind", choices=KINDS, default=None, help="Only plugins providing this kind.")
    ls.add_argument("--custom-architectures", action="append", default=None,
                    help="Also load these custom architecture modules (as the engine would).")
    ls.add_argument("--strict-plugins", action="store_true", help="Exit non-zero if any plugin failed to load.")
    new = sub.add_parser("new", help="Write a working, installable plugin package of one kind.",
                         description="Write a working, installable plugin package: pyproject.toml with the fw "
                                     "entry point, a real implementation, tests (with fw's conformance suite) "
                                     "and a README saying what to change.")
    new.add_argument("--kind", choices=SCAFFOLD_KINDS, help="What the plugin provides (required unless --example).")
    new.add_argument("name", metavar="NAME",
                     help="The name fw registers (e.g. my-backend); the package is written to DIR/fw-NAME. "
                          "With --example: the example's name.")
    new.add_argument("--output", "-o", metavar="DIR", default=".", help="Where to write the package (default: .).")
    new.add_argument("--hf-class", metavar="CLASS", default=None,
                     help="With --kind architecture: port this transformers class (e.g. Olmo2ForCausalLM), "
                          "with transformers' own config class and transformers' model as the tests' oracle.")
    new.add_argument("--example", action="store_true",
                     help="Write out fw's example plugin NAME (fw-example-arch, fw-example-plugin, fw-sampler-dry, "
                          "fw-sampler-xtc) with its tests, instead of a new package.")
    new.set_defaults(new_parser=new)


def run(args: argparse.Namespace) -> int:
    from fw.plugins.manager import rows_of_kind  # here: `fw --help` imports this module; the manager costs 20 ms

    if args.plugins_command == "new":
        return run_new(args)
    if args.plugins_command != "list":
        print("usage: fw plugins list [--json] [--kind KIND] | fw plugins new --kind KIND NAME [--output DIR] "
              "[--hf-class CLASS] | fw plugins new --example NAME")
        return 2
    rows, served = listed_plugins(args)
    rows = with_hf_architectures(rows_of_kind(rows, args.kind), served)
    if args.json:
        print(json.dumps({"plugins": rows}, indent=2))
    else:
        print(format_table(rows))
    return 0  # with --strict-plugins, a failed plugin has raised PluginLoadError: `fw` exits non-zero


def listed_plugins(args: argparse.Namespace) -> tuple[list[dict], dict[str, list[str]]]:
    """Every plugin's inventory row, and each architecture's Hugging Face class names: from the recorded
    listing while it holds (fw.plugins.listing_record), else by loading the plugins (then recorded).
    --strict-plugins or FW_STRICT_PLUGINS: a failed plugin raises PluginLoadError either way."""
    # here: as in run (the recorded listing reads through the plugin manager too)
    from fw.plugins import listing_record
    from fw.plugins.manager import get_plugin_manager, raise_for_failures

    strict = args.strict_plugins or env.STRICT_PLUGINS.get()
    found = None if args.custom_architectures else listing_record.recorded()
    if found is not None:
        rows, served, notes = found  # the failed plugins were loaded again, and said so as a full load does
        sys.stderr.write(notes)
        for row in rows:
            for warning in row["warnings"]:
                warnings.warn(f"fw plugin {row['name']} ({row['distribution']}) {warning}", stacklevel=2)
        if strict:
            raise_for_failures(rows)
        return rows, served
    manager = get_plugin_manager(strict=strict or None)
    if args.custom_architectures:
        manager.add_custom_architectures(args.custom_architectures)
    rows = manager.inventory()
    served = {spec.name: list(spec.hf_architectures) for spec in manager.registry("architecture")}
    notes = _parser_warnings(manager, args._build_parser)
    sys.stderr.write(notes)
    if not args.custom_architectures:
        listing_record.record(rows, served, notes)
    return rows, served


def _parser_warnings(manager, build_parser: Callable[[Any], argparse.ArgumentParser]) -> str:
    """What the plugins' CLI hooks print while fw's parser is built with them: `fw` builds this command's
    parser without plugins, and a listing should still show a plugin whose options fail. `build_parser` is
    fw.cli.main's, handed in through the parsed arguments: the dispatcher imports the commands, never the
    reverse."""
    with contextlib.redirect_stderr(io.StringIO()) as err:
        build_parser(manager)
    return err.getvalue()


def run_new(args: argparse.Namespace) -> int:
    # here: as in run; the scaffold's templates cost 16 ms more, which `fw --help` does not pay
    from fw.commands.scaffold import KINDS as SCAFFOLDS, new_plugin
    from fw.plugins.manager import get_plugin_manager

    if args.example:
        from fw.commands.scaffold.examples import EXAMPLES, write_example  # here: as above

        if args.kind or args.hf_class:
            args.new_parser.error("--example writes an existing example package; it takes no --kind or --hf-class")
        root = write_example(args.name, args.output)
        print(f"Wrote {root}/ ({EXAMPLES[args.name]}). Next:")
        print(f"  pip install -e '{root}'")
        print(f"  python -m pytest {root / 'tests'}" if (root / "tests").is_dir() else f"  read {root / 'README.md'}")
        return 0
    if args.kind is None:
        args.new_parser.error("the following arguments are required: --kind (or --example)")
    registry_kind = SCAFFOLDS[args.kind].registry_kind
    registry = get_plugin_manager().registry(registry_kind)
    served = {hf: spec.name for spec in registry for hf in spec.hf_architectures} \
        if registry_kind == "architecture" else {}
    root = new_plugin(args.kind, args.name, args.output, taken=registry.names(), hf_class=args.hf_class,
                      served=served)
    print(f"Wrote {root}/ ({SCAFFOLDS[args.kind].title} {args.name!r}). Next:")
    print(f"  pip install -e '{root}[test]'")
    print(f"  fw plugins list --kind {registry_kind}")
    print(f"  python -m pytest {root / 'tests'}")
    return 0


def with_hf_architectures(rows: list[dict], served: dict[str, list[str]]) -> list[dict]:
    """Each row with `hf_architectures`: per architecture it provides, the Hugging Face class names
    (config.json "architectures") it serves (`served`); empty for a fallback that serves whatever is asked."""
    for row in rows:
        names = row["provides"].get("architecture", [])
        row["hf_architectures"] = {n: list(served[n]) for n in names if n in served}
    return rows
