"""The public plugin API: what a plugin package imports from fw.

A plugin module exposes hook implementations marked with `hookimpl` and is
named in its distribution's entry points, group ``fw``::

    [project.entry-points.fw]
    my_plugin = "my_package.fw_plugin"

Optionally it declares ``FW_PLUGIN_API_VERSION = "1.0"``.

An architecture that sets `ArchitectureSpec(build_config="model")` receives a `ModelConfig`
(fw.model.config), the model's config read once, instead of the transformers config.
"""

from fw.plugins.executor import Executor, WorkerLaunch, WorkerProcess
from fw.model.config import ModelConfig, MoeConfig, RopeConfig
from fw.plugins.hookspecs import ENTRY_POINT_GROUP, hookimpl
from fw.plugins.specs import (
    ArchitectureBuild,
    ArchitectureSpec,
    AttentionBackendSpec,
    AttentionRequirements,
    CliCommandSpec,
    ExecutorSpec,
    GrammarBackendSpec,
    MoeKernelSpec,
    MoeRequirements,
    ProposerSpec,
    PerRequestSamplerStage,
    QuantizationMethodSpec,
    SamplerChoice,
    SamplerSpec,
    SamplerStage,
    ToolParserSpec,
    Verified,
)
from fw.version import PLUGIN_API_VERSION

__all__ = [
    "ENTRY_POINT_GROUP",
    "PLUGIN_API_VERSION",
    "hookimpl",
    "ArchitectureBuild",
    "ArchitectureSpec",
    "AttentionBackendSpec",
    "AttentionRequirements",
    "CliCommandSpec",
    "Executor",
    "ExecutorSpec",
    "GrammarBackendSpec",
    "MoeKernelSpec",
    "ModelConfig",
    "MoeConfig",
    "MoeRequirements",
    "PerRequestSamplerStage",
    "ProposerSpec",
    "QuantizationMethodSpec",
    "RopeConfig",
    "SamplerChoice",
    "SamplerSpec",
    "SamplerStage",
    "ToolParserSpec",
    "Verified",
    "WorkerLaunch",
    "WorkerProcess",
]
