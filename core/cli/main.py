"""`fw`: subcommands from the core (generate, plugins) plus any a plugin registers."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from fw.errors import FwError
from fw.version import PLUGIN_API_VERSION, __version__
from fw.warm.startup import pause_collector, resume_collector


def build_parser(plugins=None) -> argparse.ArgumentParser:
    # here: the commands load when the parser is built, not with `fw --version` or `import fw.cli.main`
    from fw.cli import generate, plugins_cmd, serve
    from fw.commands.bench import cli as bench
    from fw.commands.doctor import cli as doctor
    from fw.commands.warm_cache import cli as warm_cache

    parser = argparse.ArgumentParser(prog="fw", description="fw: a plugin-first LLM inference framework")
    parser.add_argument("--version", action="version", version=f"fw {__version__} (plugin API {PLUGIN_API_VERSION})")
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING (default), ERROR")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands = {}
    for module in (generate, serve, warm_cache, plugins_cmd, doctor, bench):
        p = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.configure(p)
        commands[module.NAME] = module.run
    if plugins is not None:
        for reg in plugins.registry("cli_command").registrations():
            spec = reg.spec
            if spec.name in commands:  # core commands keep their names; say so rather than drop it
                print(f"fw: warning: plugin {reg.plugin} ({reg.distribution}) registers the command "
                      f"{spec.name!r}, which is fw's own; it is ignored", file=sys.stderr)
                continue
            p = sub.add_parser(spec.name, help=spec.help, description=spec.help)
            try:
                spec.configure(p)
                commands[spec.name] = spec.run
            except Exception as exc:  # one broken plugin must not take the whole CLI down
                commands[spec.name] = _broken_command(reg, exc)
        for plugin, add_arguments in plugins.hook_implementations("fw_add_cli_arguments"):
            for name, p in sub.choices.items():
                try:
                    add_arguments(command=name, parser=p)
                except Exception as exc:
                    print(f"fw: warning: plugin {plugin} failed to add options to {name!r} "
                          f"({type(exc).__name__}: {exc}); they are missing", file=sys.stderr)
    parser.set_defaults(_commands=commands, _build_parser=build_parser)  # `fw plugins list` rebuilds it with plugins
    return parser


def _broken_command(reg, exc: Exception):
    def run(args) -> int:
        print(f"fw: error: command {reg.spec.name!r} from plugin {reg.plugin} ({reg.distribution}) "
              f"could not set up its options: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2

    return run


def _strict_flag(argv: list[str]) -> bool | None:
    """--strict-plugins / --no-strict-plugins, read before parsing because plugins shape the
    parser; None leaves FW_STRICT_PLUGINS in charge (the CLI beats the environment)."""
    if "--no-strict-plugins" in argv:
        return False
    return True if "--strict-plugins" in argv else None


def _command_words(argv: list[str]) -> list[str]:
    """The command and its first argument: the words after `fw`'s own `--log-level LEVEL`."""
    i = 0
    while i < len(argv) and argv[i].startswith("--log-level"):
        i += 1 if "=" in argv[i] else 2
    return argv[i:i + 2]


# Commands that start an engine: the collector pauses from the start (before the plugins, and torch with
# them, are imported) until the engine is up, which resumes it (fw.warm.startup.pause_collector).
STARTS_AN_ENGINE = ("serve", "generate")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    words = _command_words(argv)
    if words[:1] and words[0] in STARTS_AN_ENGINE:
        pause_collector()
    try:
        return _main(argv, words)
    finally:
        resume_collector()  # a command that failed during its start-up leaves the collector as it found it


def _main(argv: list[str], words: list[str]) -> int:
    plugins = None
    # `fw plugins list` loads the plugins itself, and only when its record of them is out of date
    if not any(a in ("--version", "-h", "--help") for a in argv[:1]) and words != ["plugins", "list"]:
        from fw.plugins.manager import get_plugin_manager  # here: 20 ms that `fw --help` does not pay

        try:
            plugins = get_plugin_manager(strict=_strict_flag(argv))
        except FwError as exc:
            print(f"fw: error: {exc}", file=sys.stderr)
            return 2
    parser = build_parser(plugins)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if not args.command:
        parser.print_help()
        return 0
    try:
        code = int(args._commands[args.command](args) or 0)
        sys.stdout.flush()  # inside the try: a closed pipe surfaces here, not at interpreter exit
        return code
    except BrokenPipeError:  # `fw plugins list --json | head`: the reader left, nothing to report
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the recipe of Python's signal docs: no second error at exit
        return 0
    except FwError as exc:
        print(f"fw: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
