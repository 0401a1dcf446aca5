"""`fw doctor`: the environment, the plugins, and for a model and engine flags what the engine
would choose for every plugin kind and why the other candidates were rejected, plus where each
configuration value came from. Reads the model's config and tokenizer only (no weights).

Exit codes: 0 when the configuration would run, 1 when it would not (the problems say why),
2 for usage errors (a bad flag value, an unreadable --config file)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from fw.plugins.table import format_table
from fw.commands.doctor.config import config_sources
from fw.config import add_config_arguments, resolve_config
from fw.errors import FwError
from fw.server.config import ServerConfig

NAME = "doctor"
HELP = "Explain the environment, the plugins, and what would be chosen for a model and flags (and why)."

SECTIONS = (
    ("architecture", "Architecture", "--model-impl"),
    ("attention_backend", "Attention backend", "--attention-backend"),
    ("moe_kernel", "MoE kernel", "--moe-backend"),
    ("quantization_method", "Quantization method", "--quantization"),
    ("sampler", "Samplers (final choice)", "--sampling-backend"),
    ("grammar_backend", "Grammar backends (per constraint kind)", "--grammar-backend"),
    ("tool_parser", "Tool-call parser", "--tool-call-parser"),
)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="Print the whole report as one JSON object.")
    add_config_arguments(p)


def run(args: argparse.Namespace) -> int:
    report = build_report(vars(args), args.config, os.environ)
    print(json.dumps(report, indent=2, default=str) if args.json else format_report(report))
    return 0 if report["would_run"] else 1


def build_report(cli: dict[str, Any], config_file: str | None, environ) -> dict[str, Any]:
    """The whole diagnosis as JSON-ready data. A bad option value raises (a usage error)."""
    # here: the diagnosis and the environment import torch, the plugin manager costs 20 ms: `fw --help` imports
    # this module, so they load with the run
    from fw.commands.doctor.checks import Diagnosis
    from fw.commands.doctor.environment import environment
    from fw.plugins.manager import PluginManager, get_plugin_manager

    # `fw serve`'s --config file may hold server keys too: accept it as it is.
    config = resolve_config(cli=cli, config_file=config_file, environ=environ, shares_file_with=(ServerConfig,))
    sources = config_sources(cli, config_file, environ)
    # As the engine does: custom architectures go into a manager of their own.
    plugins = PluginManager().load() if config.custom_architectures else get_plugin_manager()
    setup_problems = []
    if config.custom_architectures:
        try:
            plugins.add_custom_architectures(config.custom_architectures)
        except FwError as exc:
            setup_problems.append(str(exc))
    diagnosis = Diagnosis(config, plugins, sources).run()
    problems = setup_problems + diagnosis.problems
    return {
        "environment": environment(),
        "plugins": plugins.inventory(),
        "model": diagnosis.model,
        "selections": diagnosis.sections,
        # every decision the engine makes (fw.plan), with the rejected candidates: what `selections` shows
        "plan": diagnosis.plan.as_dict() if diagnosis.plan is not None else None,
        "config": diagnosis.config_rows(),
        "warnings": diagnosis.warnings,
        "problems": problems,
        "would_run": not problems,
    }


# -- text ----------------------------------------------------------------------------------------


_MARKS = {"chosen": "*", "accepted": "+", "rejected": "-", "stage": " "}


def _plain(value: Any) -> str:
    """Lists and dicts without Python's brackets and quotes."""
    if isinstance(value, dict):
        return ", ".join(f"{k.replace('_', ' ')} {_plain(v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return ", ".join(map(str, value)) or "-"
    return str(value)


def _candidate(row: dict) -> str:
    who = f"{row['plugin']}, {row['distribution']}" if row.get("plugin") else "no plugin"
    status = row["status"]
    text = f"    {_MARKS.get(status, ' ')} {row['name']:<20} {status:<8} ({who})"
    if row.get("priority") is not None:
        text += f" priority {row['priority']}"
    if row.get("order") is not None:
        text += f" order {row['order']}"
    if row["reasons"]:
        text += ": " + "; ".join(row["reasons"])
    if row.get("note"):
        text += f" [{row['note']}]"
    if row.get("verified"):
        text += f" {{verified on {row['verified']}}}"
    return text


def _section(key: str, title: str, flag: str, section: dict | None) -> list[str]:
    lines = [title]
    if section is None:
        return lines + ["    (not checked)"]
    if "skipped" in section:
        return lines + [f"    skipped: {section['skipped']}"]
    if "requested" in section:
        lines.append(f"    requested: {flag} {section['requested']} (from {section['requested_from']})")
    if section.get("requirements"):
        lines.append(f"    needs: {_plain(section['requirements'])}")
    for extra in ("model_architectures", "checkpoint_format", "gguf_weights", "chat_template"):
        if extra in section:
            lines.append(f"    {extra.replace('_', ' ')}: {_plain(section[extra])}")
    if section.get("stages"):
        lines.append("    stages, in order:")
        lines += [_candidate(r) for r in section["stages"]]
    if key == "grammar_backend":
        for kind, entry in section["by_constraint_kind"].items():
            lines.append(f"    {kind}: {entry['chosen'] or 'none'}")
            lines += ["  " + _candidate(r) for r in entry["candidates"]]
            if entry.get("note"):
                lines.append(f"        note: {entry['note']}")
    else:
        if "chosen" in section:
            lines.append(f"    chosen: {section['chosen'] or 'none'}")
        if section.get("instead"):
            lines.append(f"    instead: {section['instead']} (auto's choice: drop {flag} or pass {flag} auto)")
        lines += [_candidate(r) for r in section.get("candidates", [])]
    if section.get("note"):
        lines.append(f"    note: {section['note']}")
    if section.get("warning"):
        lines.append(f"    WARNING: {section['warning']}")
    if section.get("problem"):
        lines.append(f"    PROBLEM: {section['problem']}")
    return lines


def _config_line(row: dict) -> str:
    src = row["source"] + (f" {row['detail']}" if row["detail"] else "")
    text = f"    {row['name']:<26} {json.dumps(row['value'])} [{src}]"
    if "resolved" in row:
        r = row["resolved"]
        text += f" -> {json.dumps(r['value'])} [{r['by']}: {r['because']}]"
    return text


def format_report(report: dict[str, Any]) -> str:
    from fw.commands.doctor.environment import format_environment  # here: as in build_report (torch)

    lines = ["Environment", *format_environment(report["environment"]), "", "Plugins"]
    lines += ["    " + line for line in format_table(report["plugins"]).splitlines()]
    model = report["model"]
    lines += ["", "Model"]
    if model is None:
        lines.append("    (not resolved)")
    else:
        lines += [f"    {k.replace('_', ' ')}: {_plain(v)}" for k, v in model.items() if v is not None]
    for key, title, flag in SECTIONS:
        lines += ["", *_section(key, title, flag, report["selections"].get(key))]
    lines += ["", "Configuration (value [where it came from] -> what auto/unset resolves to [decided by: why])"]
    lines += [_config_line(r) for r in report["config"]]
    if report["warnings"]:
        lines += ["", "Warnings", *[f"    - {w}" for w in report["warnings"]]]
    if report["problems"]:
        lines += ["", "Problems", *[f"    - {p}" for p in report["problems"]]]
    lines += ["", "Verdict: this configuration would run." if report["would_run"] else
              f"Verdict: this configuration would NOT run ({len(report['problems'])} problem(s) above)."]
    return "\n".join(lines)
