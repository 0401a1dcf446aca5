"""What fw cannot split across tensor-parallel ranks yet, refused with the reason before any
worker process starts (a refusal after spawning would cost every rank a model load first).

The layers check again as they are built (fw.layers.parallel, SelfAttention, FusedExperts): that
is the rule for architectures this file knows nothing about; here the same rules are read off
the model's config so that the common cases fail in a fraction of a second."""

from __future__ import annotations

from torch import nn

from fw.config import EngineConfig
from fw.errors import ConfigError, UnsupportedConfigurationError
from fw.layers.parallel import ColumnParallelLinear, RowParallelLinear, split_heads
from fw.model.config import ModelConfig


def _refuse(tp: int, why: str) -> UnsupportedConfigurationError:
    return UnsupportedConfigurationError(f"--tensor-parallel-size {tp}: {why}")


def check_layout(config: EngineConfig) -> None:
    """--tensor-parallel-size, --nnodes, --node-rank and --dist-init-addr together."""
    tp, nodes = config.tensor_parallel_size, config.nnodes
    if config.data_parallel_size > 1:
        raise ConfigError(f"--data-parallel-size {config.data_parallel_size}: replicas run behind `fw serve`; the "
                          f"library and `fw generate` run one engine (use --data-parallel-size 1 there)")
    if config.node_rank >= nodes:
        raise ConfigError(f"--node-rank must be in 0..{nodes - 1} (--nnodes {nodes}), got {config.node_rank}")
    if tp % nodes:
        raise ConfigError(f"--tensor-parallel-size {tp} does not spread evenly over --nnodes {nodes}: give each "
                          f"node the same number of ranks")
    if nodes > 1 and not config.dist_init_addr:
        raise ConfigError(f"--nnodes {nodes}: give --dist-init-addr HOST:PORT, an address of node 0 that every "
                          f"node can reach")


def check_config(config: EngineConfig, hf_config, arch, source_kind: str = "directory") -> None:
    """Raise when `config.tensor_parallel_size` ranks cannot run this model with these flags."""
    tp = config.tensor_parallel_size
    if config.enable_torch_compile:
        raise _refuse(tp, "--enable-torch-compile is not combined with tensor parallelism yet; drop one of them")
    if str(config.device).startswith("cuda:"):
        raise _refuse(tp, f"--device {config.device} names one GPU, but rank r uses cuda:r of its node; "
                          f"give --device cuda (CUDA_VISIBLE_DEVICES chooses which GPUs)")
    if getattr(config, "enable_lora", False):
        raise _refuse(tp, "LoRA adapters are not split across ranks yet; drop --enable-lora or use "
                          "--tensor-parallel-size 1")
    if arch.fallback:
        raise _refuse(tp, f"the {arch.name} fallback runs transformers' own modules, which fw cannot split; "
                          f"use a model a native architecture plugin runs, or --tensor-parallel-size 1")
    if arch.task != "generate":
        raise _refuse(tp, f"the {arch.name} architecture is an encoder ({arch.task}); encoders run in one process")
    qcfg = getattr(hf_config, "quantization_config", None)
    method = config.quantization or (qcfg.get("quant_method") if isinstance(qcfg, dict) else
                                     getattr(qcfg, "quant_method", None) if qcfg is not None else None)
    if method:
        raise _refuse(tp, f"the model is quantized ({method}), and fw splits only dense (bf16/fp32/fp16) weights "
                          f"across ranks so far; use a dense checkpoint or --tensor-parallel-size 1")
    heads = getattr(hf_config, "num_attention_heads", None)
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads:  # the refusal SelfAttention would give after a model load, given now
        split_heads(heads, kv_heads, tp, 0)
    inter = getattr(hf_config, "intermediate_size", None)
    if isinstance(inter, int) and inter % tp:
        raise _refuse(tp, f"the model's MLP has {inter} intermediate features, which do not divide by {tp}")
    moe = ModelConfig.from_hf(hf_config).moe
    if moe is not None:  # every expert is split like an MLP (fw.layers.moe)
        for size, what in ((moe.intermediate_size, "experts have {} intermediate features each"),
                           (moe.shared_expert_intermediate_size, "shared expert has {} intermediate features")):
            if size and size % tp:
                raise _refuse(tp, f"the model's {what.format(size)}, which do not divide by {tp}; choose a "
                                  f"tensor-parallel size that divides {size}")


def check_model_is_split(model: nn.Module, arch_name: str, tp: int) -> None:
    """A model built for `tp` ranks must hold split layers: one that holds none would compute the whole
    model on every rank, correct but `tp` times the work and memory, which no one asks for."""
    if not any(isinstance(m, (ColumnParallelLinear, RowParallelLinear)) for m in model.modules()):
        raise _refuse(tp, f"the {arch_name} architecture builds no tensor-parallel layers (fw.layers' "
                          f"SelfAttention and GatedMLP split themselves; so do ColumnParallelLinear and "
                          f"RowParallelLinear in fw.layers.parallel); use --tensor-parallel-size 1")
