"""From an `EnginePlan` to a ready model: build the architecture the plan chose with its
attention backend and quantization method, and load the weights. The loader decides nothing
(fw.plan does); it builds and loads what the plan says."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from fw.config import EngineConfig
from fw.distributed.checks import check_model_is_split
from fw.distributed.group import CONTEXT_KEY as TP_CONTEXT_KEY, TensorParallel
from fw.errors import ModelLoadError
from fw.kernels import cpu_ops, dense
from fw.layers.context import ModelContext
from fw.layers.packed_embedding import embedding_from_head, embedding_from_tied_head
from fw.model import fast_attributes
from fw.model.config import ModelConfig, as_model_config
from fw.model.attention_needs import check_built_layers
from fw.model.gguf_file import GGUFModel, is_packable_linear, transform_weight, weight_transform
from fw.model.hf import generation_eos_ids, iter_safetensors
from fw.kv_cache.dtype import KvScales, bind_kv_cache
from fw.model.quantized_weights import check_expert_tensors, warn_dense_experts
from fw.model.source import ModelSource
from fw.plan import EnginePlan, resolve
from fw.plan.rules import linear_method as quantization_method
# The rules live in fw.plan.rules; the names tests import from here stay importable.
from fw.plan.rules import attention_requirements, resolve_dtype  # noqa: F401
from fw.plan.rules import quantization as _quantization  # noqa: F401
from fw.plugins.manager import PluginManager
from fw.plugins.selection import Selection
from fw.plugins.specs import ArchitectureSpec
from fw.warm import startup

logger = logging.getLogger("fw.loader")


@dataclass
class LoadedModel:
    model: torch.nn.Module
    hf_config: Any
    tokenizer: Any
    source: ModelSource
    architecture: ArchitectureSpec
    attention: Selection
    quantization: str | None
    dtype: torch.dtype
    device: torch.device
    max_length: int
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    kv_cache_dtype: torch.dtype | None = None  # what the KV cache is stored in (--kv-cache-dtype)
    plan: EnginePlan | None = None  # every decision behind this model, with the rejected candidates

    @cached_property
    def model_config(self) -> ModelConfig:
        """The model's config as the architecture read it (fw.model.config)."""
        return as_model_config(self.hf_config)


def eos_ids(hf_config, tokenizer, source: ModelSource) -> frozenset[int]:
    ids: set[int] = set()
    for value in (getattr(hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    if source.kind == "directory" and (source.path / "generation_config.json").is_file():
        try:
            ids.update(generation_eos_ids(source.path))
        except ValueError as exc:  # a broken generation_config must not block serving
            logger.warning("ignoring %s/generation_config.json: %s", source.path, exc)
    return frozenset(ids)


def load_model(cfg: EngineConfig, plugins: PluginManager, tensor_parallel: TensorParallel | None = None,
               plan: EnginePlan | None = None) -> LoadedModel:
    """`tensor_parallel`: this process's rank of a --tensor-parallel-size group (fw.distributed); the
    layers then hold only this rank's shard of the weights. `plan`: the decisions (resolved here when
    not given); the first problem in it is raised before anything is built."""
    lap = startup.laps()
    if plan is None:
        plan = resolve(cfg, plugins, explain=False)
    plan.check()
    source, device, dtype, arch, hf_config = plan.source, plan.device, plan.dtype, plan.architecture, plan.hf_config
    gguf, attention = plan.gguf, plan.attention
    for name in ("attention_backend", "quantization_method"):  # a MoE kernel's: when the build picks it
        decision = plan.decision(name)
        if decision is not None and decision.warning:
            logger.warning("%s", decision.warning)
    quant_name = plan.quantization
    linear_method = quantization_method(plugins, quant_name, plan.quant_config)
    head_from_embedding = gguf is not None and _keeps_tied_head(gguf, hf_config, linear_method, device)
    if head_from_embedding:
        hf_config.tie_word_embeddings = False  # the LM head gets the embedding's blocks as a linear of its own
    lap(startup.RESOLVE)
    cpu_ops.prepare(device)  # fused CPU layer ops, built (or loaded from the cache) before the model
    dense.prepare(device, dtype)  # and fw's bf16 matmul kernel for a bf16 model
    lap(startup.CPP_OPS)
    ctx = ModelContext(dtype=dtype, device=device, attention_backend=attention.chosen.backend_cls,
                       linear_method=linear_method, extra={"moe_kernel": plan.moe_kernels})
    if tensor_parallel is not None:
        ctx.extra[TP_CONTEXT_KEY] = tensor_parallel
    loaded_config = as_model_config(hf_config)  # read once, after the tied-head choice above
    with torch.device("cpu"):
        model = arch.build(loaded_config if arch.build_config == "model" else hf_config, ctx, plan.max_length)
    if tensor_parallel is not None:
        check_model_is_split(model, arch.name, tensor_parallel.size)
    check_built_layers(model, attention.chosen)
    if quant_name is not None:
        warn_dense_experts(model, quant_name)
    if quant_name is not None and gguf is None and getattr(hf_config, "quantization_config", None):
        check_expert_tensors(model, source.path, quant_name, arch.name)
    weights = _gguf_weights(cfg, gguf, arch, hf_config, dtype, linear_method, head_from_embedding) \
        if gguf is not None else iter_safetensors(source.path)
    kv_scales = KvScales()
    weights = kv_scales.filter(weights)
    try:
        loaded = model.load_weights(weights)
    except ModelLoadError:
        raise
    except (ValueError, RuntimeError) as exc:
        raise ModelLoadError(f"{source.path}: weights do not fit the {arch.name} architecture: {exc}") from None
    if head_from_embedding:  # before the check: the embedding's rows come from the head's blocks, never loaded dense
        embedding_from_head(model)
    missing = sorted(n for n, _ in model.named_parameters() if n not in loaded)
    if missing:
        raise ModelLoadError(f"{source.path}: checkpoint lacks {len(missing)} weights, e.g. {', '.join(missing[:3])}")
    if not head_from_embedding:
        embedding_from_tied_head(model)  # the rows from a tied head packed for the dense kernel: no second copy
    bind_kv_cache(model, plan.kv_cache_dtype, kv_scales)
    model.to(device).eval()
    fast_attributes.freeze(model)  # its structure is final: lookups in the steps skip nn.Module.__getattr__
    lap(startup.LOAD_WEIGHTS)
    logger.info("loaded %s (%s, %s) with attention backend %s", source.name, arch.name, dtype, attention.chosen.name)
    return LoadedModel(model, hf_config, plan.tokenizer, source, arch, attention, quant_name, dtype, device,
                       plan.max_length, eos_ids(hf_config, plan.tokenizer, source), kv_cache_dtype=plan.kv_cache_dtype,
                       # without the GGUF reader: its memory map of the file goes with the load's other temporaries
                       plan=dataclasses.replace(plan, gguf=None))


def _keeps_tied_head(gguf: GGUFModel, hf_config, linear_method, device: torch.device) -> bool:
    """A tied LM head keeps the embedding's GGUF blocks when the method that keeps GGUF blocks has a fast
    kernel for their type on this device (the `gguf` plugin's `keeps_tied_head`): the head is the largest
    single weight, and its dense copy would read twice the bytes per token."""
    keeps = getattr(linear_method, "keeps_tied_head", None)
    kind = gguf.tensor_type("token_embd.weight")
    return (getattr(hf_config, "tie_word_embeddings", False) and keeps is not None and kind is not None
            and keeps(kind, device, hf_config.hidden_size))


def _gguf_weights(cfg: EngineConfig, gguf: GGUFModel, arch: ArchitectureSpec, hf_config, dtype: torch.dtype,
                  linear_method, head_from_embedding: bool = False):
    """A GGUF file's tensors: linear weights still packed for a method that keeps GGUF blocks (the `gguf`
    plugin), all dequantized otherwise (--gguf-dequantize-at-load, or --quantization NAME, whose method
    then quantizes the float tensors its own way); q/k rows re-ordered per --rope-type."""
    keep = is_packable_linear if getattr(linear_method, "keeps_gguf_blocks", False) else None
    weights = gguf.iter_weights(dtype, keep_packed=keep, head_from_embedding=head_from_embedding)
    transform = weight_transform(cfg.rope_type, arch.gguf_weight_transform)
    if transform is not None:
        weights = ((n, transform_weight(transform, n, t, hf_config)) for n, t in weights)
    return weights
