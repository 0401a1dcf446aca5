"""docs/flags.md is generated from the configuration dataclasses and the commands' parsers, and
the committed file is what the generator writes today."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from fw.commands import flag_reference
from fw.commands.flag_reference import REGENERATE, generate
from fw.config import EngineConfig, _opt, env_name, flag_name
from fw.server.config import ServerConfig

REPO = Path(__file__).resolve().parent.parent
FLAGS_MD = REPO / "docs" / "flags.md"


def test_committed_flag_reference_is_up_to_date():
    committed, fresh = FLAGS_MD.read_text(), generate()
    if committed != fresh:
        delta = "".join(list(difflib.unified_diff(committed.splitlines(True), fresh.splitlines(True),
                                                  "docs/flags.md (committed)", "generated"))[:60])
        raise AssertionError(f"docs/flags.md is out of date: regenerate it with `{REGENERATE}` "
                             f"(from the checkout's root).\n{delta}")


def test_every_config_field_is_documented_with_its_flag_env_var_and_help():
    text = generate()
    for cls in (EngineConfig, ServerConfig):
        for f in dataclasses.fields(cls):
            rows = [line for line in text.splitlines()
                    if line.startswith(f"| `{flag_name(f.name)}`") and f"| `{env_name(f.name)}` |" in line]
            assert len(rows) == 1, f.name
            assert f"| `{f.name}` |" in rows[0]
            assert " ".join(f.metadata["help"].split()).replace("|", "\\|") in rows[0]


def test_every_core_command_option_is_documented():
    from fw.cli.main import build_parser

    text = generate()
    for path, parser in flag_reference._walk(build_parser(plugins=None), "fw"):
        assert f"### `{path}`" in text
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            for option in action.option_strings:
                assert f"`{option}`" in text, (path, option)


@dataclass
class _DemoConfig:
    """What a new engine field looks like in the reference."""

    widget_count: int = field(default=3, metadata=_opt("How many widgets | at most."))
    widget_mode: str = field(default="fast", metadata=_opt("The mode.", choices=("fast", "exact")))
    use_widgets: bool = field(default=True, metadata=_opt("Widgets on or off."))
    widget_paths: list[str] = field(default_factory=list, metadata=_opt("Extra widgets.", repeatable=True))
    widget_name: str | None = field(default=None, metadata=_opt("A name."))


def test_rows_follow_the_dataclass():
    rows = {row[0]: row for row in flag_reference._config_rows(_DemoConfig)}
    assert rows["`--widget-count`"] == ["`--widget-count`", "`FW_WIDGET_COUNT`", "`widget_count`", "int", "`3`",
                                        "How many widgets \\| at most."]
    assert rows["`--widget-mode`"][3:5] == ["`fast` \\| `exact`", "`fast`"]
    assert rows["`--use-widgets` / `--no-use-widgets`"][3:5] == ["bool", "on"]
    assert rows["`--widget-paths`"][3:5] == ["list of strings, repeatable", "none"]
    assert rows["`--widget-name`"][3:5] == ["string", "none"]


def test_command_option_rows():
    parser = argparse.ArgumentParser(prog="fw demo")
    parser.add_argument("--level", choices=("a", "b"), default="a", help="Pick %(default)s or b.")
    parser.add_argument("--item", action="append", help="Repeat it.")
    parser.add_argument("--flag", action="store_true")
    parser.add_argument("name", metavar="NAME", help="The name.")
    rows = {row[0]: row for row in (flag_reference._option_row(a, parser) for a in parser._actions)}
    assert rows["`--level`"] == ["`--level`", "`a` \\| `b`", "`a`", "Pick a or b."]
    assert rows["`--item`"][1:3] == ["string, repeatable", "none"]
    assert rows["`--flag`"][1:3] == ["switch", "off"]
    assert rows["`NAME`"][2:] == ["required", "The name."]


def test_the_regenerate_command_prints_the_reference():
    proc = subprocess.run([sys.executable, "-m", "fw.commands.flag_reference"], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == generate()
