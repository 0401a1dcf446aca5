"""The rules behind each decision of the engine plan: device, dtype, architecture, attention
requirements, quantization, tokenizer. Only `fw.plan.resolver` calls them (and the loader's
compatibility names re-export them), so a changed rule changes the engine, `fw doctor`,
`fw warm-cache` and the compile-cache key together."""

from __future__ import annotations

import logging
from typing import Any

import torch

from fw.config import QUANTIZATION_ENCODINGS, EngineConfig
from fw.devices import cuda_capability
from fw.errors import ConfigError, UnsupportedArchitectureError, UnsupportedConfigurationError
from fw.kernels import packed_int
from fw.layers.encoder import BidirectionalAttention
from fw.model.config import as_model_config
from fw.model.attention_needs import logit_softcap_needed, sliding_window_needed
from fw.model.gguf_file import GGUFModel
from fw.kernels.hardware import cpu_has_native_bf16
from fw.model.hf import load_tokenizer
from fw.kv_cache.dtype import kv_cache_requirement
from fw.model.quantized_weights import check_method_supported
from fw.model.source import ModelSource
from fw.plugins.manager import PluginManager
from fw.plugins.selection import unverified_warning
from fw.plugins.specs import ArchitectureSpec, AttentionBackendSpec, AttentionRequirements, ExecutorSpec

logger = logging.getLogger("fw.loader")

# What the plan names as the attention of encoder-only architectures (task "embed"): their layers use
# fw.layers.BidirectionalAttention (torch SDPA within each sequence), not a paged-KV backend plugin.
ENCODER_ATTENTION = AttentionBackendSpec("bidirectional", BidirectionalAttention,
                                         description="encoders' own attention (fw.layers.BidirectionalAttention)")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_MAX_LENGTH = 2048  # when the model's config names no context length


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: no CUDA device is available here; use --device cpu")
    return device


def choose_executor(cfg: EngineConfig, plugins: PluginManager, launched: bool) -> ExecutorSpec:
    """--distributed-executor-backend: the executor named, or auto's (vLLM's rule): `external_launcher`
    when a launcher started this process (`launched`: torchrun's env:// variables are set), `uni` at one
    rank, `mp` above. An unknown name, or one that cannot run the layout, is a ConfigError naming the
    installed executors."""
    registry = plugins.registry("executor")
    name, flag = cfg.distributed_executor_backend, "--distributed-executor-backend"
    if name == "auto":
        name = "external_launcher" if launched else "uni" if cfg.tensor_parallel_size == 1 else "mp"
        flag = f"{flag} auto (which chose {name})"
    else:
        flag = f"{flag} {name}"
    if name not in registry:
        raise ConfigError(f"{flag}: no executor of that name is installed; installed: "
                          f"{', '.join(registry.names()) or '(none)'} (`fw plugins list --kind executor`)")
    spec = registry.get(name)
    reasons = spec.rejection_reasons(cfg.tensor_parallel_size, cfg.nnodes)
    if reasons:
        fits = [s.name for s in registry if not s.rejection_reasons(cfg.tensor_parallel_size, cfg.nnodes)]
        raise ConfigError(f"{flag} cannot run --tensor-parallel-size {cfg.tensor_parallel_size} over --nnodes "
                          f"{cfg.nnodes}: it {'; it '.join(reasons)}; executors that can: {', '.join(fits) or '(none)'}")
    return spec


def resolve_dtype(name: str, hf_config, source: ModelSource, device: torch.device) -> torch.dtype:
    """`--dtype auto`: bf16 on CPUs with native bf16 (about 1.8x fp32's decode speed there), fp32 on other
    CPUs (their bf16 and fp16 are emulated and slower); on GPUs the checkpoint's dtype, and bf16 (else fp16)
    for GGUF files, whose dequantized weights have no dtype of their own. See docs/choices.md."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cpu":
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    if source.kind == "gguf":
        return torch.bfloat16 if device.type != "cuda" or torch.cuda.is_bf16_supported() else torch.float16
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = DTYPES.get(dtype, torch.float32)
    return dtype


def model_max_length(hf_config) -> tuple[int, bool]:
    """The model's context length, and whether its config names one (else DEFAULT_MAX_LENGTH)."""
    named = int(getattr(hf_config, "max_position_embeddings", 0) or 0)
    return (named or DEFAULT_MAX_LENGTH), bool(named)


def find_architecture(plugins: PluginManager, hf_names: list[str], gguf_arch: str | None = None,
                      model_impl: str = "auto", hf_config: Any = None) -> ArchitectureSpec:
    """The spec that runs the model. `model_impl` (--model-impl): `fw` only native specs (matched by
    name), `transformers` only a fallback spec (which judges the config), `auto` native first."""
    registry = plugins.registry("architecture")
    specs = architectures_in_order(plugins)
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


def architectures_in_order(plugins: PluginManager) -> list[ArchitectureSpec]:
    """--custom-architectures are an explicit choice: they win over plugins claiming the same HF name
    under another spec name (a stable sort keeps plugin order otherwise)."""
    custom = set(plugins.custom_architectures)
    return sorted(plugins.registry("architecture"), key=lambda s: s.name not in custom)


def attention_requirements(cfg: EngineConfig, hf_config, dtype: torch.dtype,
                           device: torch.device) -> AttentionRequirements:
    """What the attention backend must support for this model and these flags."""
    head_dim = as_model_config(hf_config).head_dim
    return AttentionRequirements(
        device=device.type, dtype=str(dtype).removeprefix("torch."), head_size=head_dim,
        page_size=cfg.kv_cache_page_size,
        sliding_window=sliding_window_needed(hf_config), logit_softcap=logit_softcap_needed(hf_config),
        kv_cache_dtype=kv_cache_requirement(cfg.kv_cache_dtype, dtype), capability=cuda_capability(device),
    )


def num_experts(hf_config) -> int:
    """Experts per MoE layer as the config names them (Mixtral, Qwen-MoE, DeepSeek); 0 for a dense model."""
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


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


def checkpoint_quantization(hf_config) -> dict | None:
    """The checkpoint's `quantization_config` as a dict, or None."""
    qcfg = getattr(hf_config, "quantization_config", None)
    if qcfg is not None and not isinstance(qcfg, dict):
        qcfg = qcfg.to_dict()
    return qcfg


def quantization_config(cfg: EngineConfig, hf_config, device: torch.device, gguf_source: bool) -> dict | None:
    """What the quantization method reads: the checkpoint's config, or for a GGUF file whose weights stay
    packed the file itself (`{"quant_method": "gguf", ...}`). Refuses contradicting GGUF flags."""
    qcfg = checkpoint_quantization(hf_config)
    if gguf_source and cfg.gguf_dequantize_at_load and cfg.quantization == "gguf":
        raise ConfigError("--quantization gguf keeps GGUF weights packed; --gguf-dequantize-at-load dequantizes "
                          "them: pass one of the two")
    if gguf_source and not gguf_dequantizes_at_load(cfg, device) and cfg.quantization is None:
        # a GGUF file is its own quantization config: weights stay packed
        qcfg = {"quant_method": "gguf", "dense_fallback": gguf_dense_fallback(cfg, device)}
    return qcfg


def quantization_reasons(spec, device: torch.device) -> list[str]:
    """Why a quantization method cannot run on `device` (its devices, its libraries), or []."""
    reasons = [] if device.type in spec.devices else [f"device {device.type!r} not supported "
                                                      f"(supports {', '.join(spec.devices)})"]
    why = spec.available() if spec.available is not None else None
    if why:
        reasons.append(why)
    return reasons


def choose_quantization(cfg: EngineConfig, hf_config, arch: ArchitectureSpec, plugins: PluginManager,
                        device: torch.device, gguf_source: bool = False
                        ) -> tuple[str | None, dict | None, str | None]:
    """The quantization method's name (None: dense), the config it reads and the warning to log when it
    runs unverified here: `--quantization NAME`, else the first plugin that detects the checkpoint's format."""
    registry = plugins.registry("quantization_method")
    qcfg = quantization_config(cfg, hf_config, device, gguf_source)
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
        return None, qcfg, None
    spec = registry.get(name)
    reasons = quantization_reasons(spec, device)
    if reasons:
        raise UnsupportedConfigurationError(f"quantization {name!r} cannot run here: {'; '.join(reasons)}")
    check_method_supported(arch, name)
    warning = unverified_warning("quantization method", spec, device.type, cuda_capability(device),
                                 "--quantization names it" if cfg.quantization else "the checkpoint is in its format")
    return name, qcfg, warning


def quantization(cfg: EngineConfig, hf_config, arch: ArchitectureSpec, plugins: PluginManager,
                 device: torch.device, gguf_source: bool = False) -> tuple[str | None, Any]:
    """`choose_quantization`, logging its warning, and the chosen method's linear method (None, None: dense)."""
    name, qcfg, warning = choose_quantization(cfg, hf_config, arch, plugins, device, gguf_source)
    if warning:
        logger.warning("%s", warning)
    return name, linear_method(plugins, name, qcfg)


def linear_method(plugins: PluginManager, name: str | None, qcfg: dict | None) -> Any:
    """The quantization method `name` made for the checkpoint's config `qcfg` (None for dense weights)."""
    return None if name is None else plugins.registry("quantization_method").get(name).factory(qcfg or {})


def check_quantization_encoding(cfg: EngineConfig, source: ModelSource, gguf: GGUFModel | None) -> None:
    """--quantization-encoding naming a GGUF weight type (q4_0, q4_k, ...): the model must be a GGUF file whose
    linear weights are of that type, as MAX refuses an encoding the weights are not in. (float32, bfloat16,
    float8_e4m3fn and gptq became --dtype or --quantization in the config.)"""
    encoding = cfg.quantization_encoding
    if encoding is None or QUANTIZATION_ENCODINGS[encoding][0] is not None:
        return
    want = QUANTIZATION_ENCODINGS[encoding][1]
    if source.kind != "gguf":
        raise ConfigError(f"--quantization-encoding {encoding} names a GGUF weight type, but {source.name} is not a "
                          f".gguf file; drop the flag (fw reads a checkpoint's encoding from its files)")
    found = (gguf or GGUFModel(source.path)).linear_weight_type()
    if found != want:
        raise ConfigError(f"--quantization-encoding {encoding}: the linear weights of {source.path.name} are "
                          f"{found or 'not quantized'}, not {want}; drop the flag (fw reads the encoding from the "
                          f"file) or name the file's own")


def tokenizer_origin(cfg: EngineConfig, source: ModelSource) -> str:
    """Where the tokenizer comes from: --tokenizer, the GGUF file's own vocabulary, or the model directory."""
    if cfg.tokenizer:
        return f"--tokenizer {cfg.tokenizer}"
    return "the GGUF file's vocabulary" if source.kind == "gguf" else "the model directory"


def open_tokenizer(cfg: EngineConfig, source: ModelSource, gguf: GGUFModel | None = None) -> Any:
    """The transformers tokenizer from `tokenizer_origin`, with --chat-template in place of its own template.
    The template is set on this process's tokenizer object after it is loaded, never written into the
    tokenizer's snapshot (fw.model.fast_tokenizer), so an engine without the flag gets the model's."""
    if cfg.tokenizer:
        tok = load_tokenizer(cfg.tokenizer, cfg.trust_remote_code)
    elif source.kind == "gguf":
        tok = (gguf or GGUFModel(source.path)).tokenizer()
    else:
        tok = load_tokenizer(source.path, cfg.trust_remote_code)
    if cfg.chat_template is not None:
        from fw.chat_template import load_chat_template  # here: jinja2 only when a template is given

        tok.chat_template = load_chat_template(cfg.chat_template)
    return tok
