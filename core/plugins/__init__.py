"""The public plugin API: what a plugin package imports from fw.

A plugin module exposes hook implementations marked with `hookimpl` and is
named in its distribution's entry points, group ``fw``::

    [project.entry-points.fw]
    my_plugin = "my_package.fw_plugin"

Optionally it declares ``FW_PLUGIN_API_VERSION = "1.0"``.

An architecture that sets `ArchitectureSpec(build_config="model")` receives a `ModelConfig`
(fw.model.config), the model's config read once, instead of the transformers config.

Per plugin kind, this package holds the spec a plugin registers, and, imported from here, the contract it
implements and the types the core hands it (`CONTRACTS`; they live beside the code that calls them and load
when first asked for, so `import fw.plugins` stays without torch). The building blocks architectures are made
of are fw.layers.
"""

from typing import TYPE_CHECKING, Any

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

# name -> the module that defines it: per kind, the contract a plugin implements and the types the core hands it
CONTRACTS = {
    # attention_backend
    "AttentionBackend": "fw.layers.attention", "AttentionMetadata": "fw.layers.attention",
    # quantization_method
    "LinearMethod": "fw.layers.linear", "UnquantizedLinearMethod": "fw.layers.linear",
    # moe_kernel
    "MoeKernel": "fw.layers.moe", "FusedExperts": "fw.layers.moe",
    # sampler
    "SamplingBatch": "fw.sampling.batch", "SamplingParams": "fw.sampling.params",
    "SamplerRequest": "fw.sampling.params",
    # grammar_backend
    "GrammarCompiler": "fw.grammar.contract", "CompiledGrammar": "fw.grammar.contract",
    "GrammarMatcher": "fw.grammar.contract", "GrammarError": "fw.grammar.contract",
    "Constraint": "fw.grammar.constraint", "GrammarTokenizer": "fw.grammar.tokenizer",
    # tool_parser
    "ToolParser": "fw.tool_parsing", "ToolCall": "fw.tool_parsing",
    # proposer
    "Proposer": "fw.speculative.contract", "ProposerContext": "fw.speculative.contract",
    "DraftRequest": "fw.speculative.contract", "Draft": "fw.speculative.contract",
    # fw_warm_cache_artifacts
    "WarmArtifact": "fw.warm.artifact", "WarmItem": "fw.warm.artifact", "WarmContext": "fw.warm.artifact",
}

if TYPE_CHECKING:  # for type checkers; at run time __getattr__ imports them when first asked for
    from fw.grammar.constraint import Constraint
    from fw.grammar.contract import CompiledGrammar, GrammarCompiler, GrammarError, GrammarMatcher
    from fw.grammar.tokenizer import GrammarTokenizer
    from fw.layers.attention import AttentionBackend, AttentionMetadata
    from fw.layers.linear import LinearMethod, UnquantizedLinearMethod
    from fw.layers.moe import FusedExperts, MoeKernel
    from fw.sampling.batch import SamplingBatch
    from fw.sampling.params import SamplerRequest, SamplingParams
    from fw.speculative.contract import Draft, DraftRequest, Proposer, ProposerContext
    from fw.tool_parsing import ToolCall, ToolParser
    from fw.warm.artifact import WarmArtifact, WarmContext, WarmItem


def __getattr__(name: str) -> Any:
    if name in CONTRACTS:
        import importlib  # here: the contracts import torch, which `import fw.plugins` does not

        return getattr(importlib.import_module(CONTRACTS[name]), name)
    raise AttributeError(f"module 'fw.plugins' has no attribute {name!r}")

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
    *CONTRACTS,
]
