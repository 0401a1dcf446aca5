"""Which engine runs a model, decided by its architecture plugin before any weight is read.

A causal LM runs on `LLMEngine` (the scheduler over the paged KV cache), for generation or, with
--task embed, for embeddings pooled from its hidden states. An encoder-only model (an architecture
whose spec says `task="embed"`) runs on fw.pooling's `EncoderEngine`: no KV cache, embeddings only."""

from __future__ import annotations

import dataclasses

from fw.config import EngineConfig
from fw.engine.engine import LLMEngine
from fw.errors import ConfigError, UnsupportedConfigurationError
from fw.plan import resolve
from fw.plugins.manager import PluginManager, engine_plugins
from fw.plugins.specs import ArchitectureSpec
from fw.pooling.encoder_engine import EncoderEngine


def model_architecture(config: EngineConfig, plugins: PluginManager | None = None) -> ArchitectureSpec:
    """The architecture spec that will run `config.model` (reads its config, not its weights)."""
    if plugins is None or config.custom_architectures:  # with custom ones, a private look: the engine loads
        plugins = engine_plugins(config, None)         # them into a manager of its own
    plan = resolve(config, plugins, tokenizer=False, explain=False, until="architecture")
    plan.check("model", "architecture")
    return plan.architecture


def resolve_task(config: EngineConfig, arch: ArchitectureSpec) -> str:
    """--task against what the architecture can do: an encoder only embeds; a decoder generates by
    default and embeds when asked."""
    if arch.task == "embed" and config.task == "generate":
        raise ConfigError(f"--task generate: the {arch.name} architecture is an encoder-only embedding model; "
                          f"it serves embeddings (--task embed or auto), not text generation")
    if arch.task == "embed" and config.enable_lora:
        raise ConfigError(f"--enable-lora: LoRA adapters run on causal LMs; the {arch.name} architecture is an "
                          f"encoder-only embedding model")
    return arch.task if config.task == "auto" else config.task


def create_engine(config: EngineConfig, plugins: PluginManager | None = None) -> LLMEngine | EncoderEngine:
    if config.model is None:  # nothing to look at: LLMEngine says what is missing
        return LLMEngine(config, plugins)
    arch = model_architecture(config, plugins)
    task = resolve_task(config, arch)
    config = dataclasses.replace(config, task=task)
    if arch.task == "embed":
        if config.tensor_parallel_size > 1:  # fw.distributed splits decoders (LLMEngine) only
            raise UnsupportedConfigurationError(
                f"--tensor-parallel-size {config.tensor_parallel_size}: the {arch.name} architecture is an encoder, "
                f"and encoders run in one process; use --tensor-parallel-size 1")
        return EncoderEngine(config, plugins)
    return LLMEngine(config, plugins)
