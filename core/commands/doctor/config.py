"""Where each engine option's value came from: the dataclass default, the YAML `--config` file
(or `FW_CONFIG`), an `FW_*` variable, or the command line, in `fw.config.resolve_config`'s
precedence (CLI > environment > file > default). The values themselves always come from
`resolve_config`; this module only labels them, so the two cannot disagree on a value."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from fw import env
from fw.config import EngineConfig, env_name, flag_name, load_yaml_options


def config_sources(cli: dict[str, Any] | None, config_file: str | None,
                   environ: dict[str, str] | None = None, cls: type = EngineConfig) -> dict[str, dict[str, str]]:
    """field name -> {"source": default | config file | environment | cli, "detail": flag, file or variable}."""
    environ = os.environ if environ is None else environ
    config_file = config_file or env.CONFIG.get(environ)
    from_file = load_yaml_options(config_file) if config_file else {}
    out: dict[str, dict[str, str]] = {}
    for f in dataclasses.fields(cls):
        name = f.name
        if (cli or {}).get(name) is not None:
            out[name] = {"source": "cli", "detail": flag_name(name)}
        elif env_name(name) in environ:
            out[name] = {"source": "environment", "detail": env_name(name)}
        elif name in from_file:
            out[name] = {"source": "config file", "detail": str(config_file)}
        else:
            out[name] = {"source": "default", "detail": ""}
    return out


def show(value: Any) -> Any:
    """A config value as JSON can hold it."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [show(v) for v in value]
    return str(value)
