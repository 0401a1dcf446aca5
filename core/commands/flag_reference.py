"""docs/flags.md, generated: every option of every core command, read from the configuration
dataclasses (engine and server options: flag, `FW_*` variable, YAML key, type, default) and from
the commands' own argparse parsers (everything else). Plugin commands and options are left out,
since they depend on what is installed.

    python -m fw.commands.flag_reference > docs/flags.md

tests/test_flag_reference.py fails when the committed file differs from this output.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any, Iterator

from fw.cli.main import build_parser
from fw.config import EngineConfig, _fields, env_name, flag_name
from fw.env import SWITCHES
from fw.server.config import ServerConfig

REGENERATE = "python -m fw.commands.flag_reference > docs/flags.md"

# add_config_arguments titles its group "<title> (also FW_<NAME> env vars and --config YAML keys)"
_CONFIG_GROUPS = {"engine options": EngineConfig}


def _server_config() -> type:
    return ServerConfig


def _cell(text: Any) -> str:
    """Text fit for one Markdown table cell."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _code(text: Any) -> str:
    return f"`{text}`"


def _type_name(tp: Any) -> str:
    names = {str: "string", int: "int", float: "float", bool: "bool", list: "list of strings", dict: "JSON object"}
    return names.get(tp, getattr(tp, "__name__", str(tp)).lstrip("_"))


def _default(value: Any) -> str:
    if value is None or value == []:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    return _code(value)


def _walk(parser: argparse.ArgumentParser, path: str) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every command parser under `parser`, depth first, in the order they were added."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, f"{path} {name}")


def _config_group(action: argparse.Action, parser: argparse.ArgumentParser) -> str | None:
    """"engine options" / "server options" when `action` was added by add_config_arguments."""
    for group in parser._action_groups:
        if action in group._group_actions and group.title:
            for title in ("engine options", "server options"):
                if group.title.startswith(f"{title} (also FW_"):
                    return title
    return None


def _option_row(action: argparse.Action, parser: argparse.ArgumentParser) -> list[str]:
    if action.option_strings:
        names = ", ".join(_code(s) for s in action.option_strings)
    else:
        names = _code(action.metavar or action.dest)
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        value = " | ".join(_code(c) for c in action.choices)
    elif action.nargs == 0:
        value = "switch"
    elif action.metavar:
        value = str(action.metavar)
    else:
        value = _type_name(action.type or str)
    if isinstance(action, argparse._AppendAction):
        value += ", repeatable"
    if action.required or not action.option_strings:
        default = "required"
    elif action.default is argparse.SUPPRESS:
        default = ""
    else:
        default = _default(action.default)
    text = action.help or ""
    if "%(" in text:
        try:
            text = text % {**vars(action), "prog": parser.prog}
        except (KeyError, TypeError, ValueError):
            pass
    return [names, _cell(value), default, _cell(text)]


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _config_rows(cls: type) -> list[list[str]]:
    rows = []
    for f, tp in _fields(cls):
        meta = dict(f.metadata)
        flag = _code(flag_name(f.name))
        if tp is bool:
            flag += " / " + _code("--no-" + flag_name(f.name)[2:])
        aliases = [f"{_code(alias)} ({system})" for alias, system in meta.get("aliases", ())]
        aliases += [f"{_code(alias)} ({system}, = {_code('--no-' + flag_name(f.name)[2:])})"
                    for alias, system in meta.get("negated_aliases", ())]
        if aliases:
            flag += "; also " + ", ".join(aliases)
        if "choices" in meta:
            kind = " \\| ".join(_code(c) for c in meta["choices"])
        else:
            kind = _type_name(tp) + (", repeatable" if meta.get("repeatable") else "")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        rows.append([flag, _code(env_name(f.name)), _code(f.name), kind, _default(default),
                     _cell(meta.get("help", ""))])
    return rows


def generate() -> str:
    """The whole of docs/flags.md."""
    root = build_parser(plugins=None)
    commands = list(_walk(root, "fw"))
    takes: dict[str, list[str]] = {"engine options": [], "server options": []}
    for path, parser in commands:
        groups = {_config_group(a, parser) for a in parser._actions} - {None}
        for group in sorted(groups):
            takes[group].append(_code(path))
    out = [
        "# Flag reference",
        "",
        f"<!-- Generated by `{REGENERATE}`; do not edit by hand (tests/test_flag_reference.py checks it). -->",
        "",
        "Every option of fw's own commands, generated from the configuration dataclasses",
        "(`fw.config.EngineConfig`, `fw.server.config.ServerConfig`) and the commands' parsers.",
        "Engine and server options are also read from `FW_<NAME>` environment variables and from the",
        "YAML file given with `--config` (keys: the field name, with dashes or underscores); the command",
        "line wins over the environment, which wins over the file. Boolean options have a `--no-` form.",
        "Where vLLM, SGLang, TGI or MAX name an option differently, that name works too (\"also\": a",
        "command-line alias of the same option, with the system it mirrors).",
        "How they combine, and what the commands do: [cli.md](cli.md). Commands and options added by",
        "plugins are not listed here (they depend on what is installed): `fw COMMAND --help` shows them.",
        "",
        "Contents: [engine options](#engine-options), [server options](#server-options),",
        "[environment switches](#environment-switches), [command options](#command-options).",
        "",
        "## Engine options",
        "",
        "Taken by " + ", ".join(takes["engine options"]) + "; the library `LLM(...)` takes the same names",
        "as keyword arguments.",
        "",
    ]
    header = ["flag", "env var", "YAML key / `LLM(...)` keyword", "type", "default", "meaning"]
    out += _table(header, _config_rows(EngineConfig))
    out += ["", "## Server options", "", "Taken by " + ", ".join(takes["server options"]) + ".", ""]
    out += _table(["flag", "env var", "YAML key", "type", "default", "meaning"], _config_rows(_server_config()))
    out += ["", "## Environment switches", "",
            "`FW_*` variables that are not engine options: they act below the engine (the cache, the CPU",
            "kernels, plugin loading) or before a configuration exists, so they have no flag. Each is",
            "declared once in `fw.env` and read only through it. A value a switch cannot read is an error",
            "naming the variable.", ""]
    out += _table(["variable", "type", "default", "meaning"],
                  [[_code(s.name), s.kind, s.default_text, _cell(s.doc)] for s in SWITCHES])
    out += ["", "## Command options", "",
            "Options of each command besides the engine and server options above. These have no `FW_*`",
            "variable and no YAML key.", ""]
    for path, parser in commands:
        own = [a for a in parser._actions
               if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
               and _config_group(a, parser) is None]
        subcommands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        groups = sorted({_config_group(a, parser) for a in parser._actions} - {None})
        out += [f"### `{path}`", ""]
        if parser.description:
            out += [_cell(parser.description), ""]
        if subcommands:
            names = ", ".join(_code(f"{path} {name}") for a in subcommands for name in a.choices)
            out += [f"Subcommands: {names}.", ""]
        if groups:
            out += ["Also takes the " + " and the ".join(f"[{g}](#{g.replace(' ', '-')})" for g in groups) + ".", ""]
        if own:
            out += _table(["option", "value", "default", "meaning"], [_option_row(a, parser) for a in own])
            out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def main() -> int:
    sys.stdout.write(generate())
    return 0


if __name__ == "__main__":
    sys.exit(main())
