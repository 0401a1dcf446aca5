"""The names one plugin NAME becomes: distribution, import package, entry point, classes.

One rule everywhere, so a generated package's files agree with each other and with what fw shows:
NAME `my-backend` is registered as `my-backend`, installed as distribution `fw-my-backend`, imported
as `fw_my_backend`, listed under entry point `my_backend`, and its classes start `MyBackend`."""

from __future__ import annotations

import re
from dataclasses import dataclass

from fw.errors import ConfigError

NAME_PATTERN = re.compile(r"^[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*$")
MAX_NAME_LENGTH = 40


@dataclass(frozen=True)
class PluginNames:
    name: str  # the registered name (--attention-backend NAME, samplers=[{"name": NAME}], ...)
    distribution: str  # the pip distribution and the directory written
    package: str  # the import package
    entry_point: str  # the key under [project.entry-points.fw]
    camel: str  # class-name prefix

    @classmethod
    def from_name(cls, name: str) -> "PluginNames":
        check_name(name)
        base = re.sub(r"^fw[-_]", "", name)  # `fw plugins new fw-foo` should not give fw-fw-foo
        parts = re.split(r"[-_]", base)
        snake = "_".join(parts)
        return cls(name=name, distribution="fw-" + "-".join(parts), package="fw_" + snake, entry_point=snake,
                   camel="".join(p.capitalize() for p in parts))


def check_name(name: str) -> None:
    """Raise ConfigError saying what a valid NAME looks like."""
    problem = None
    if not NAME_PATTERN.match(name):
        problem = ("use lowercase letters and digits, starting with a letter, with single '-' or '_' between "
                   "words")
    elif len(name) > MAX_NAME_LENGTH:
        problem = f"use at most {MAX_NAME_LENGTH} characters"
    elif name == "fw":
        problem = "'fw' is the framework's own distribution"
    if problem:
        raise ConfigError(f"invalid plugin name {name!r}: {problem} (e.g. 'my-backend', 'int8_rows')")
