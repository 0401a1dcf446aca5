"""From an `EngineConfig` to a ready model: resolve files, pick the architecture,
attention backend and quantization method through the registries, build the
model and load its weights."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from fw.config import EngineConfig
from fw.devices import cuda_capability
from fw.distributed.checks import check_model_is_split
from fw.distributed.group import CONTEXT_KEY as TP_CONTEXT_KEY, TensorParallel
from fw.errors import ConfigError, ModelLoadError, UnsupportedArchitectureError, UnsupportedConfigurationError
from fw.layers import cpu_ops, dense, packed_int
from fw.layers.context import ModelContext
from fw.model_config import ModelConfig, as_model_config
from fw.layers.encoder import BidirectionalAttention
from fw.model_loader.attention_needs import check_built_layers, logit_softcap_needed, sliding_window_needed
from fw.model_loader.gguf_file import GGUFModel, is_packable_linear, transform_weight, weight_transform
from fw.model_loader.hardware import cpu_has_native_bf16
from fw.model_loader.kv_cache_dtype import KvScales, bind_kv_cache, kv_cache_requirement, resolve_kv_cache_dtype
from fw.model_loader.hf import generation_eos_ids, iter_safetensors, load_hf_config, load_tokenizer
from fw.model_loader.quantized_weights import check_expert_tensors, check_method_supported, warn_dense_experts
from fw.model_loader.source import ModelSource, resolve_model
from fw.plugins.manager import PluginManager
from fw.plugins.selection import MoeKernelChooser, Selection, select_attention_backend, unverified_warning
from fw.plugins.specs import ArchitectureSpec, AttentionBackendSpec, AttentionRequirements
from fw.warm import startup

logger = logging.getLogger("fw.loader")

# What `LoadedModel.attention` names for encoder-only architectures (task "embed"): their layers use
# fw.layers.BidirectionalAttention (torch SDPA within each sequence), not a paged-KV backend plugin.
ENCODER_ATTENTION = AttentionBackendSpec("bidirectional", BidirectionalAttention,
                                         description="encoders' own attention (fw.layers.BidirectionalAttention)")


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

    @cached_property
    def model_config(self) -> ModelConfig:
        """The model's config as the architecture read it (fw.model_config)."""
        return as_model_config(self.hf_config)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: no CUDA device is available here; use --device cpu")
    return device


def resolve_dtype(name: str, hf_config, source: ModelSource, device: torch.device) -> torch.dtype:
    """`--dtype auto`: bf16 on CPUs with native bf16 (about 1.8x fp32's decode speed there), fp32 on other
    CPUs (their bf16 and fp16 are emulated and slower); on GPUs the checkpoint's dtype, and bf16 (else fp16)
    for GGUF files, whose dequantized weights have no dtype of their own. See docs/choices.md."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    if source.kind == "gguf":
        return torch.bfloat16 if device.type != "cuda" or torch.cuda.is_bf16_supported() else torch.float16
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = _DTYPES.get(dtype, torch.float32)
    return dtype


def find_architecture(plugins: PluginManager, hf_names: list[str], gguf_arch: str | None = None,
                      model_impl: str = "auto", hf_config: Any = None) -> ArchitectureSpec:
    """The spec that runs the model. `model_impl` (--model-impl): `fw` only native specs (matched by
    name), `transformers` only a fallback spec (which judges the config), `auto` native first."""
    registry = plugins.registry("architecture")
    # --custom-architectures are an explicit choice: they win over plugins claiming the
    # same HF name under another spec name (stable sort keeps plugin order otherwise).
    custom = set(plugins.custom_architectures)
    specs = sorted(registry, key=lambda s: s.name not in custom)
    wanted = gguf_arch or ", ".join(hf_names) or "(config.json lists no architectures)"
    if model_impl != "transformers":
        for spec in specs:
            if spec.fallback:
                continue
            if gguf_arch is not None and gguf_arch in spec.gguf_architectures:
                return spec
            if any(n in spec.hf_architectures for n in hf_names):
                return spec
    if gguf_arch is not None and model_impl == "transformers":
        raise UnsupportedConfigurationError(
            "--model-impl transformers runs Hugging Face checkpoint directories (config.json + safetensors), "
            "not GGUF files; use --model-impl auto or fw for a .gguf model")
    fallbacks = [s for s in specs if s.fallback]
    refusals = []  # (fallback name, why it cannot run the model)
    if gguf_arch is None:
        for spec in fallbacks:
            why = spec.rejection_reason(hf_config) if spec.rejection_reason is not None else None
            if why is None and model_impl != "fw":
                return spec
            if why is None:
                raise UnsupportedArchitectureError(
                    f"--model-impl fw: no native architecture plugin handles {wanted}. The {spec.name} fallback "
                    f"can run it through transformers' modelling code: use --model-impl transformers (or auto).")
            refusals.append((spec.name, why))
    if model_impl == "transformers":
        raise UnsupportedArchitectureError(
            f"--model-impl transformers: "
            + ("; ".join(f"the {n} fallback cannot run {wanted}: {why}" for n, why in refusals)
               or "no fallback architecture plugin is loaded (is the built-in `transformers` plugin disabled?)"))
    known = sorted({a for s in registry for a in (*s.hf_architectures, *s.gguf_architectures)})
    notes = "".join(f"; the {n} fallback (--model-impl transformers) cannot run it either: {why}"
                    for n, why in refusals)
    raise UnsupportedArchitectureError(
        f"no architecture plugin handles {wanted}. Supported natively: {', '.join(known) or 'none'}{notes}. "
        f"Install a plugin that adds it, or pass --custom-architectures."
    )


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


def model_config(cfg: EngineConfig, plugins: PluginManager, source: ModelSource,
                 gguf: GGUFModel | None = None) -> tuple[Any, ArchitectureSpec]:
    """The model's transformers config and the architecture spec that runs it."""
    if source.kind == "gguf":
        gguf = gguf or GGUFModel(source.path)
        arch = find_architecture(plugins, [], gguf.architecture, cfg.model_impl)
        return gguf.hf_config(arch.hf_architectures[0]), arch
    hf_config = load_hf_config(source.path, cfg.trust_remote_code, cfg.revision)
    arch = find_architecture(plugins, list(getattr(hf_config, "architectures", None) or []), None,
                             cfg.model_impl, hf_config)
    return hf_config, arch


def attention_requirements(cfg: EngineConfig, hf_config, dtype: torch.dtype,
                           device: torch.device) -> AttentionRequirements:
    """What the attention backend must support for this model and these flags."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    return AttentionRequirements(
        device=device.type, dtype=str(dtype).removeprefix("torch."), head_size=head_dim,
        page_size=cfg.kv_cache_page_size,
        sliding_window=sliding_window_needed(hf_config), logit_softcap=logit_softcap_needed(hf_config),
        kv_cache_dtype=kv_cache_requirement(cfg.kv_cache_dtype, dtype), capability=cuda_capability(device),
    )


def load_model(cfg: EngineConfig, plugins: PluginManager, tensor_parallel: TensorParallel | None = None) -> LoadedModel:
    """`tensor_parallel`: this process's rank of a --tensor-parallel-size group (fw.distributed); the
    layers then hold only this rank's shard of the weights."""
    lap = startup.laps()
    source = resolve_model(cfg.model, cfg.revision)
    device = resolve_device(cfg.device)
    gguf = GGUFModel(source.path) if source.kind == "gguf" else None
    hf_config, arch = model_config(cfg, plugins, source, gguf)
    if gguf is not None:
        tokenizer = load_tokenizer(cfg.tokenizer, cfg.trust_remote_code) if cfg.tokenizer else gguf.tokenizer()
    else:
        tokenizer = load_tokenizer(cfg.tokenizer or source.path, cfg.trust_remote_code)
    dtype = resolve_dtype(cfg.dtype, hf_config, source, device)

    model_max = int(getattr(hf_config, "max_position_embeddings", 0) or 0) or 2048
    max_length = cfg.max_length or model_max
    if max_length > model_max:
        raise ConfigError(f"--max-length {max_length} exceeds the model's context length {model_max}")

    if arch.task == "embed":  # an encoder attends within each sequence itself: no backend, no KV cache
        attention = Selection(ENCODER_ATTENTION)
    else:
        req = attention_requirements(cfg, hf_config, dtype, device)
        name = None if cfg.attention_backend == "auto" else cfg.attention_backend
        attention = select_attention_backend(plugins.registry("attention_backend"), req, name)
    if attention.warning:
        logger.warning("%s", attention.warning)

    quant_name, linear_method = _quantization(cfg, hf_config, arch, plugins, device, gguf is not None)
    head_from_embedding = gguf is not None and _keeps_tied_head(gguf, hf_config, linear_method, device)
    if head_from_embedding:
        hf_config.tie_word_embeddings = False  # the LM head gets the embedding's blocks as a linear of its own
    lap(startup.RESOLVE)
    cpu_ops.prepare(device)  # fused CPU layer ops, built (or loaded from the cache) before the model
    dense.prepare(device, dtype)  # and fw's bf16 matmul kernel for a bf16 model
    lap(startup.CPP_OPS)
    ctx = ModelContext(dtype=dtype, device=device, attention_backend=attention.chosen.backend_cls,
                       linear_method=linear_method,
                       extra={"moe_kernel": MoeKernelChooser(plugins.registry("moe_kernel"), cfg.moe_backend)})
    if tensor_parallel is not None:
        ctx.extra[TP_CONTEXT_KEY] = tensor_parallel
    loaded_config = as_model_config(hf_config)  # read once, after the tied-head choice above
    with torch.device("cpu"):
        model = arch.build(loaded_config if arch.build_config == "model" else hf_config, ctx, max_length)
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
    missing = sorted(n for n, _ in model.named_parameters() if n not in loaded)
    if missing:
        raise ModelLoadError(f"{source.path}: checkpoint lacks {len(missing)} weights, e.g. {', '.join(missing[:3])}")
    kv_dtype = resolve_kv_cache_dtype(cfg.kv_cache_dtype, dtype)
    bind_kv_cache(model, kv_dtype, kv_scales)
    model.to(device).eval()
    lap(startup.LOAD_WEIGHTS)
    logger.info("loaded %s (%s, %s) with attention backend %s", source.name, arch.name, dtype, attention.chosen.name)
    return LoadedModel(model, hf_config, tokenizer, source, arch, attention, quant_name, dtype, device, max_length,
                       eos_ids(hf_config, tokenizer, source), kv_cache_dtype=kv_dtype)


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


def gguf_dequantizes_at_load(cfg: EngineConfig, device: torch.device) -> bool:
    """`--gguf-dequantize-at-load`, or when not given: no where fw's packed-int CPU kernels run (they decode
    a Q4_1 SmolLM2 faster than its dense weights; types without a kernel are dequantized layer by layer,
    see `gguf_dense_fallback`); yes on other CPUs (the plain-torch dequantize-per-matmul decodes at 14.8 tok/s
    against 92.3 dense); no elsewhere (device memory is the scarce resource there). `--quantization gguf`
    always keeps weights packed."""
    if cfg.gguf_dequantize_at_load is not None:
        return cfg.gguf_dequantize_at_load
    return device.type == "cpu" and cfg.quantization != "gguf" and not packed_int.ready()


def gguf_dense_fallback(cfg: EngineConfig, device: torch.device) -> bool:
    """Kept packed by default on a CPU with the kernels: layers of a type without one go dense at load."""
    return cfg.gguf_dequantize_at_load is None and cfg.quantization is None and device.type == "cpu"


def _quantization(cfg: EngineConfig, hf_config, arch: ArchitectureSpec, plugins: PluginManager,
                  device: torch.device, gguf_source: bool = False):
    registry = plugins.registry("quantization_method")
    qcfg = getattr(hf_config, "quantization_config", None)
    if qcfg is not None and not isinstance(qcfg, dict):
        qcfg = qcfg.to_dict()
    if gguf_source and cfg.gguf_dequantize_at_load and cfg.quantization == "gguf":
        raise ConfigError("--quantization gguf keeps GGUF weights packed; --gguf-dequantize-at-load dequantizes "
                          "them: pass one of the two")
    if gguf_source and not gguf_dequantizes_at_load(cfg, device) and cfg.quantization is None:
        # a GGUF file is its own quantization config: weights stay packed
        qcfg = {"quant_method": "gguf", "dense_fallback": gguf_dense_fallback(cfg, device)}
    name = cfg.quantization
    if name is None and qcfg:
        matches = [s for s in registry if s.detects is not None and s.detects(qcfg)]
        if not matches:
            raise UnsupportedConfigurationError(
                f"the checkpoint is quantized ({qcfg.get('quant_method', 'unknown method')}) but no installed "
                f"quantization plugin reads that format; installed: {', '.join(registry.names()) or 'none'}"
                + (" (or pass --gguf-dequantize-at-load to run the GGUF file on dense weights)" if gguf_source else "")
            )
        name = matches[0].name
    if name is None:
        return None, None
    spec = registry.get(name)
    reasons = [] if device.type in spec.devices else [f"device {device.type!r} not supported "
                                                      f"(supports {', '.join(spec.devices)})"]
    why = spec.available() if spec.available is not None else None
    if why:
        reasons.append(why)
    if reasons:
        raise UnsupportedConfigurationError(f"quantization {name!r} cannot run here: {'; '.join(reasons)}")
    check_method_supported(arch, name)
    warning = unverified_warning("quantization method", spec, device.type, cuda_capability(device),
                                 "--quantization names it" if cfg.quantization else "the checkpoint is in its format")
    if warning:
        logger.warning("%s", warning)
    return name, spec.factory(qcfg or {})
