"""How fw announces that part of the plugin API is going away.

A hook, or one of its arguments, is deprecated through pluggy's own hookspec options, so the
warning fires when a plugin that *implements* it is registered, pointing at the plugin's code::

    @hookspec(warn_on_impl_args={"state": plugin_api_deprecation(
        "fw_add_server_routes(state)", since="1.3", removed_in="2.0", instead="app.state.fw")})
    def fw_add_server_routes(app, state) -> None: ...

Spec fields and type members are deprecated with `warn_deprecated` where the old spelling is read.
The warning class derives from FutureWarning, not DeprecationWarning: Python hides
DeprecationWarnings raised outside `__main__` by default, and a plugin module is never `__main__`.
"""

from __future__ import annotations

import warnings


class PluginApiDeprecationWarning(FutureWarning):
    """Part of the fw plugin API a plugin uses is deprecated; it still works until `removed_in`."""


def plugin_api_deprecation(what: str, *, since: str, removed_in: str, instead: str) -> PluginApiDeprecationWarning:
    """The warning to hand to a hookspec's `warn_on_impl` / `warn_on_impl_args` (one wording everywhere)."""
    return PluginApiDeprecationWarning(
        f"{what} is deprecated since fw plugin API {since} and will be removed in {removed_in}; "
        f"use {instead} instead (docs/plugin-api.md lists every deprecation)")


def warn_deprecated(what: str, *, since: str, removed_in: str, instead: str, stacklevel: int = 3) -> None:
    """Warn now, from code that reads a deprecated spec field or calls a deprecated member."""
    warnings.warn(plugin_api_deprecation(what, since=since, removed_in=removed_in, instead=instead),
                  stacklevel=stacklevel)
