"""`fw warm-cache`: download, verify and pre-build everything `fw serve` with the
same flags needs, then exit; `--check` only reports what is cached."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fw.config import add_config_arguments, resolve_config
from fw.default_model import default_model
from fw.server.config import ServerConfig
from fw.warm.artifact import WarmContext

NAME = "warm-cache"
HELP = ("Download and verify the model and pre-build what serving it needs (C++ kernels, compiled steps, "
        "grammars), so `fw serve` with the same flags starts fast; --check reports what is cached.")


def configure(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("warm-cache options")
    w.add_argument("--check", action="store_true",
                   help="Only report, per artifact, what is cached (hit) and what would be built (miss); "
                        "build and download nothing.")
    w.add_argument("--force-download", action="store_true",
                   help="Download the model's files again even if the HF cache has them.")
    w.add_argument("--warm-schemas", type=Path, default=None, metavar="FILE",
                   help="JSON list of structured-output constraints (JSON schemas, or objects with json / regex "
                        "/ choice / grammar) to precompile with the grammar backend the server would use.")
    w.add_argument("--target-device", default=None, metavar="DEV",
                   help="Prepare for this device instead of the one --device resolves to here, where the "
                        "artifact can be built for another device (C++ CPU kernels cannot: they are built "
                        "for the machine that runs them).")
    add_config_arguments(p)


def run(args: argparse.Namespace) -> int:
    # here: `fw --help` imports this module; the artifacts (torch) and the plugin manager (20 ms) load with
    # the run
    from fw.commands.warm_cache.collect import collect
    from fw.commands.warm_cache.runner import describe_target
    from fw.commands.warm_cache.runner import run as run_artifacts
    from fw.plugins.manager import engine_plugins

    # the YAML file `fw serve --config` reads may hold server keys too: warm-cache ignores them
    config = resolve_config(cli=vars(args), config_file=args.config, shares_file_with=(ServerConfig,))
    if config.model is None:
        config.model = default_model()
    plugins = engine_plugins(config)  # as the engine picks them
    if config.attention_backend != "auto":  # a mistyped name fails now, as `fw serve` would
        plugins.registry("attention_backend").get(config.attention_backend)
    options = {"check": args.check, "force_download": args.force_download,
               "warm_schemas": args.warm_schemas, "target_device": args.target_device}
    context = WarmContext(config=config, plugins=plugins, options=options)
    contributions = collect(context)  # reads --warm-schemas: a bad file fails before any work
    mode = "checking" if args.check else "warming"
    print(f"fw warm-cache: {mode} {config.model}", flush=True)
    summary = run_artifacts(contributions, context, build=not args.check,
                            emit=lambda line: print(line, flush=True))
    target = describe_target(context)
    if target:
        print(target)
    print(summary.line(), flush=True)
    if summary.failed:
        print(f"fw: error: {summary.failed} artifact(s) failed (see the FAILED lines above)", file=sys.stderr)
        return 1
    return 0
