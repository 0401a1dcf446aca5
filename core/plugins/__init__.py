"""The public plugin API: what a plugin package imports from fw.

A plugin module exposes hook implementations marked with `hookimpl` and is
named in its distribution's entry points, group ``fw``::

    [project.entry-points.fw]
    my_plugin = "my_package.fw_plugin"

Optionally it declares ``FW_PLUGIN_API_VERSION = "1.0"``.
"""

from fw.plugins.hookspecs import ENTRY_POINT_GROUP, hookimpl
from fw.plugins.specs import (
    ArchitectureSpec,
    AttentionBackendSpec,
    AttentionRequirements,
    CliCommandSpec,
    GrammarBackendSpec,
    MoeKernelSpec,
    MoeRequirements,
    ProposerSpec,
    QuantizationMethodSpec,
    SamplerSpec,
    ToolParserSpec,
    Verified,
)
from fw.version import PLUGIN_API_VERSION

__all__ = [
    "ENTRY_POINT_GROUP",
    "PLUGIN_API_VERSION",
    "hookimpl",
    "ArchitectureSpec",
    "AttentionBackendSpec",
    "AttentionRequirements",
    "CliCommandSpec",
    "GrammarBackendSpec",
    "MoeKernelSpec",
    "MoeRequirements",
    "ProposerSpec",
    "QuantizationMethodSpec",
    "SamplerSpec",
    "ToolParserSpec",
    "Verified",
]
