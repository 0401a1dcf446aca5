"""Typed registries: one per plugin kind, keyed by a unique name."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Generic, Iterator, TypeVar

from fw.errors import DuplicatePluginNameError, UnknownImplementationError

logger = logging.getLogger("fw.plugins")

T = TypeVar("T")


@dataclass
class Registration(Generic[T]):
    """One implementation and who registered it."""

    spec: T
    plugin: str  # the plugin's name (entry-point name, or "custom:<module>")
    distribution: str  # the distribution that ships it
    overrides: list[str] = field(default_factory=list)  # distributions it replaced
    override: bool = False  # registered with override=True


class Registry(Generic[T]):
    """Implementations of one kind by name. Duplicates need an explicit override."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Registration[T]] = {}

    def add(self, spec: T, plugin: str, distribution: str, override: bool = False) -> Registration[T]:
        """Register `spec`; returns the registration now in effect under its name.

        An override wins whichever side loads first: plugins load in distribution-name
        order, so an overriding plugin may register before the one it replaces."""
        name = getattr(spec, "name", None)
        if not isinstance(name, str) or not name:
            raise TypeError(f"{self.kind} registered by {distribution} has no name: {spec!r}")
        previous = self._entries.get(name)
        if previous is not None and not override and not previous.override:
            raise DuplicatePluginNameError(
                f"{self.kind} {name!r} is registered twice: by {previous.distribution} "
                f"(plugin {previous.plugin}) and by {distribution} (plugin {plugin}). "
                f"Uninstall or disable one of them (FW_DISABLE_PLUGINS), or have the later "
                f"one register with override=True."
            )
        if previous is not None and not override:  # the earlier registration overrides this one
            previous.overrides.append(distribution)
            logger.warning("%s %r from %s overrides the one from %s", self.kind, name, previous.distribution,
                           distribution)
            return previous
        overrides = []
        if previous is not None:
            overrides = [*previous.overrides, previous.distribution]
            logger.warning(
                "%s %r from %s overrides the one from %s", self.kind, name, distribution, previous.distribution
            )
        self._entries[name] = Registration(spec, plugin, distribution, overrides, override)
        return self._entries[name]

    def remove_plugin(self, plugin: str) -> list[str]:
        """Drop everything `plugin` registered (it failed half-way); returns the names dropped."""
        names = [n for n, r in self._entries.items() if r.plugin == plugin]
        for name in names:
            del self._entries[name]
        return names

    def get(self, name: str) -> T:
        try:
            return self._entries[name].spec
        except KeyError:
            raise UnknownImplementationError(
                f"no {self.kind.replace('_', ' ')} named {name!r}; registered: "
                f"{', '.join(sorted(self._entries)) or '(none)'}. "
                f"Run `fw plugins list --kind {self.kind}` to see what is installed."
            ) from None

    def registration(self, name: str) -> Registration[T]:
        self.get(name)
        return self._entries[name]

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[T]:
        return (r.spec for r in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def registrations(self) -> list[Registration[T]]:
        return list(self._entries.values())

    def names(self) -> list[str]:
        return sorted(self._entries)
