"""The hook specs: the whole contract between the core and plugins.

Every registration hook receives a `register` callback; call it once per
implementation: ``register(spec)`` or ``register(spec, override=True)`` to
replace an implementation of the same name from another plugin (logged and
shown by ``fw plugins list``). Registering through a callback, rather than
returning values, lets the core attribute every implementation to the plugin
that registered it.
"""

from __future__ import annotations

import pluggy

PROJECT_NAME = "fw"
ENTRY_POINT_GROUP = "fw"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def fw_register_architectures(register) -> None:
    """Register `ArchitectureSpec`s (model families keyed by HF architecture names)."""


@hookspec
def fw_register_attention_backends(register) -> None:
    """Register `AttentionBackendSpec`s."""


@hookspec
def fw_register_moe_kernels(register) -> None:
    """Register `MoeKernelSpec`s: how Mixture-of-Experts layers compute their experts."""


@hookspec
def fw_register_quantization_methods(register) -> None:
    """Register `QuantizationMethodSpec`s."""


@hookspec
def fw_register_samplers(register) -> None:
    """Register `SamplerSpec`s: logits stages or final token choosers."""


@hookspec
def fw_register_grammar_backends(register) -> None:
    """Register `GrammarBackendSpec`s."""


@hookspec
def fw_register_tool_parsers(register) -> None:
    """Register `ToolParserSpec`s: tool-call parsers for chat requests with tool_choice auto."""


@hookspec
def fw_register_proposers(register) -> None:
    """Register `ProposerSpec`s: speculative-decoding proposers, named by `--speculative-config`'s method."""


@hookspec
def fw_register_executors(register) -> None:
    """Register `ExecutorSpec`s: how the ranks of a tensor-parallel engine start, named by
    `--distributed-executor-backend`."""


@hookspec
def fw_register_cli_commands(register) -> None:
    """Register `CliCommandSpec`s: new `fw <name>` subcommands."""


@hookspec
def fw_add_cli_arguments(command: str, parser) -> None:
    """Add options to an existing subcommand's argparse parser (`command` is its name)."""


@hookspec
def fw_add_server_routes(app, state) -> None:
    """Add routes to `fw serve`'s FastAPI `app`; `state` (fw.server.state.ServerState) gives
    the engine, served names and metrics. A plugin that raises here is logged and skipped."""


@hookspec
def fw_warm_cache_artifacts(context, add) -> None:
    """Contribute what `fw warm-cache` should prepare before serving: call ``add(artifact)`` once per
    `fw.warm.WarmArtifact` (a kernel build, autotuning results, precompiled grammars, repacked
    weights). `context` (fw.warm.WarmContext) holds the engine configuration the server would run
    with, the resolved model once its files are present, and warm-cache's own options
    (``context.options["warm_schemas"]``, ``["target_device"]``). Add nothing when the flags do not
    need it. Each artifact is shown in the warm-cache report; see docs/warm-cache.md."""
