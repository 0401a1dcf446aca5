"""The transformers fallback: a decoder-only causal LM that fw has no native plugin for runs through
transformers' own modelling code, with fw's paged KV cache and fw's selected attention backend.

How it joins the two: fw registers an attention function (`fw_paged`) with transformers'
`AttentionInterface` and builds the HF model with ``attn_implementation="fw_paged"``. Each HF
attention module (found by its `layer_idx`) is bound to an fw `Attention` layer, which owns that
layer's paged cache like in any native architecture. A step's tokens, from all its sequences, go
through HF as one sequence ``[1, T]`` with fw's positions as `position_ids` and ``use_cache=False``;
the attention function hands HF's q/k/v (already rotated by HF) to fw's backend, which reads each
sequence's context from the cache and masks by fw's step metadata. `fw_paged` has no mask function
registered, so transformers builds no attention mask. Logits come from the HF model's own head,
including whatever it applies after it (final soft-capping, logit scaling).

Selected with ``--model-impl transformers``, or by ``auto`` when no native plugin claims the model.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn

from fw.errors import ModelLoadError, UnsupportedArchitectureError, UnsupportedConfigurationError
from fw.layers import Attention, AttentionMetadata, ModelContext
from fw.plugins import ArchitectureSpec, ModelConfig, hookimpl

FW_PLUGIN_API_VERSION = "1.0"

ATTN_IMPLEMENTATION = "fw_paged"

# Layer kinds whose state lives in the KV cache; any other (linear attention, convolution, SSM)
# keeps state that fw's use_cache=False steps would drop.
_KV_LAYER_TYPES = {"full_attention", "sliding_attention"}


# -- which models it can run --------------------------------------------------------------------


def _causal_lm_class(hf_config) -> tuple[type | None, str | None]:
    """The transformers causal-LM class for the config's `architectures`, or (None, why not)."""
    import transformers  # here: transformers costs start-up time (plugin listing loads this module)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # here: as above

    names = list(getattr(hf_config, "architectures", None) or [])
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    for name in names:
        if name in causal:
            return getattr(transformers, name), None
    wanted = ", ".join(names) or "(config.json lists no architectures)"
    return None, f"transformers has no causal-LM class named {wanted}"


def rejection_reason(hf_config) -> str | None:
    """None when the fallback can run this model, else why it cannot (shown to the user)."""
    if getattr(hf_config, "is_encoder_decoder", False):
        return "it is an encoder-decoder model; the fallback runs decoder-only causal LMs"
    cls, why = _causal_lm_class(hf_config)
    if cls is None:
        return why
    if not cls.is_backend_compatible():
        return (f"transformers' {cls.__name__} does not route its attention through AttentionInterface "
                f"(_supports_attention_backend is False), so fw cannot give it the paged KV cache")
    other = sorted(set(getattr(hf_config, "layer_types", None) or ()) - _KV_LAYER_TYPES)
    if other:
        return (f"its layer types {', '.join(other)} keep state outside the KV cache, which fw does not "
                f"carry between steps")
    return None


# -- the attention function transformers calls --------------------------------------------------


class _Step:
    """The current step's metadata, shared by the model and its attention bindings."""

    meta: AttentionMetadata | None = None


@dataclass
class _Binding:
    """What an HF attention module is joined to: its fw layer, and the settings its backend has."""

    layer: Attention
    step: _Step
    ctx: ModelContext
    settings: tuple[float, int | None, float | None]  # scale, sliding window, soft-cap

    def check(self, module_name: str, settings: tuple[float, int | None, float | None]) -> None:
        """HF passes scale, window and soft-cap with every call; a backend takes them at construction.
        A new scale rebuilds the backend instance. A window or cap other than the one read from the
        config is refused: the backend was chosen (and checked) for the config's."""
        if settings == self.settings:
            return
        if settings[1:] != self.settings[1:]:
            raise UnsupportedArchitectureError(
                f"{module_name} attends with sliding window {settings[1]} and soft-cap {settings[2]}, but its "
                f"config announced {self.settings[1]} and {self.settings[2]}; the transformers fallback cannot "
                f"run this model")
        layer = self.layer
        layer.impl = self.ctx.attention_backend(layer.num_heads, layer.num_kv_heads, layer.head_dim, settings[0],
                                                sliding_window=settings[1], logit_softcap=settings[2])
        self.settings = settings


_UNSUPPORTED_KWARGS = {"s_aux": "attention sinks (s_aux)"}


def fw_paged_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                       **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: q [1, H, T, D], k/v [1, Hkv, T, D], after HF's
    rotary. Returns [1, T, H, D] and no attention weights."""
    binding: _Binding | None = module.__dict__.get("_fw_binding")
    name = type(module).__name__
    if binding is None or binding.step.meta is None:
        raise UnsupportedArchitectureError(
            f"{name} (layer {getattr(module, 'layer_idx', '?')}) called attention without an fw KV-cache "
            f"binding; the transformers fallback cannot run this model. Use a native architecture plugin.")
    for key_name, what in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(key_name) is not None:
            raise UnsupportedArchitectureError(f"{name} uses {what}, which fw's attention backends do not apply")
    if attention_mask is not None or not getattr(module, "is_causal", True):
        raise UnsupportedArchitectureError(
            f"{name} attends with its own mask or non-causally; fw's paged attention is causal per sequence")
    layer = binding.layer
    _, h, t, d = query.shape
    if query.shape[0] != 1 or (h, key.shape[1], d, value.shape[-1]) != (layer.num_heads, layer.num_kv_heads,
                                                                        layer.head_dim, layer.head_dim):
        raise UnsupportedArchitectureError(
            f"{name}: q/k/v shapes {tuple(query.shape)}/{tuple(key.shape)}/{tuple(value.shape)} do not fit the "
            f"fw layer ({layer.num_heads} heads, {layer.num_kv_heads} KV heads, head dim {layer.head_dim})")
    scale = float(scaling) if scaling is not None else d**-0.5
    window = kwargs["sliding_window"] if "sliding_window" in kwargs else binding.settings[1]
    softcap = kwargs["softcap"] if "softcap" in kwargs else binding.settings[2]
    binding.check(name, (scale, window or None, softcap or None))
    q = query[0].transpose(0, 1).reshape(t, h * d)
    k = key[0].transpose(0, 1).reshape(t, layer.num_kv_heads * d)
    v = value[0].transpose(0, 1).reshape(t, layer.num_kv_heads * d)
    return layer(q, k, v, binding.step.meta).view(1, t, h, d), None


def register_attention_function() -> None:
    """Register `fw_paged` with transformers (idempotent). No mask function is registered on purpose:
    transformers then skips building masks for this implementation, and fw's backend masks by its metadata."""
    # here: transformers costs start-up time (plugin listing loads this module)
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, fw_paged_attention)


# -- the model ----------------------------------------------------------------------------------


class _GivenHidden(nn.Module):
    """Stands in for the HF base model while the head runs: returns the hidden states it holds."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden

    def forward(self, *args: Any, **kwargs: Any):
        from transformers.modeling_outputs import BaseModelOutputWithPast  # here: as above

        return BaseModelOutputWithPast(last_hidden_state=self.hidden)


def _attention_modules(hf: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules that call the attention function: HF names them *Attention and gives them a layer_idx."""
    return [(name, m) for name, m in hf.named_modules() if type(m).__name__.endswith("Attention")
            and isinstance(getattr(m, "layer_idx", None), int)]


def _layer_settings(module: nn.Module,
                    cfg: ModelConfig) -> tuple[int, int, int, tuple[float, int | None, float | None]]:
    """Heads, KV heads, head dim and (scale, window, soft-cap) of one HF attention module, as far as its
    attributes and the config tell; every call checks them against what HF actually passes."""
    heads = cfg.num_attention_heads
    head_dim = getattr(module, "head_dim", None) or getattr(module, "head_size", None) or cfg.head_dim
    groups = getattr(module, "num_key_value_groups", None)
    kv_heads = heads // groups if groups else cfg.num_key_value_heads
    scale = getattr(module, "scaling", None) or head_dim**-0.5
    layer_types = cfg.layer_types
    if hasattr(module, "sliding_window"):
        window = module.sliding_window
    elif layer_types:
        window = cfg.sliding_window if layer_types[module.layer_idx] == "sliding_attention" else None
    else:  # an older config without layer types slides in every layer if it names a window (Mistral)
        window = cfg.sliding_window if cfg.use_sliding_window is not False else None
    softcap = getattr(module, "attn_logit_softcapping", None) or cfg.attn_logit_softcapping
    return heads, kv_heads, head_dim, (float(scale), window or None, softcap or None)


class TransformersCausalLM(nn.Module):
    """fw's architecture interface (forward, compute_logits, load_weights) around a transformers model.

    `build` makes the HF model on the meta device (no memory, no weight init) to find its attention
    modules and give each an fw `Attention` layer; `load_weights` then has transformers build the
    real model from the checkpoint's tensors (its own renaming, fusing, tying and dtype rules) and
    binds the real modules to those layers."""

    def __init__(self, hf_config, ctx: ModelContext):
        super().__init__()
        why = rejection_reason(hf_config)
        if why is not None:
            raise UnsupportedArchitectureError(f"the transformers fallback cannot run this model: {why}")
        if ctx.linear_method is not None:  # transformers' own nn.Linear layers would ignore it
            raise UnsupportedConfigurationError(
                "the transformers fallback runs transformers' own layers, which fw's quantization methods do "
                "not reach; drop --quantization, or use a native architecture plugin")
        register_attention_function()
        self.cls, _ = _causal_lm_class(hf_config)
        self.ctx = ctx
        real = getattr(hf_config, "transformers_config", None)  # fw's recorded config: the object itself
        self.config = copy.deepcopy(real() if callable(real) else hf_config)  # transformers writes dtype and attention choice into it
        with torch.device("meta"):
            self.hf = self.cls._from_config(copy.deepcopy(self.config), attn_implementation=ATTN_IMPLEMENTATION,
                                            dtype=ctx.dtype)
        self.step = _Step()
        self.attention = nn.ModuleDict()  # HF module name (dots as "/") -> its fw layer
        self.settings: dict[str, tuple[float, int | None, float | None]] = {}
        model_config = ModelConfig.from_hf(self.config)
        for name, module in _attention_modules(self.hf):
            heads, kv_heads, head_dim, settings = _layer_settings(module, model_config)
            self.attention[name.replace(".", "/")] = Attention(
                heads, kv_heads, head_dim, ctx, scale=settings[0], sliding_window=settings[1],
                logit_softcap=settings[2])
            self.settings[name] = settings
        if not self.attention:
            raise UnsupportedArchitectureError(
                f"the transformers fallback found no attention modules with a layer_idx in {self.cls.__name__}")
        self.prefix = self.cls.base_model_prefix

    def _bind(self) -> None:
        """Point every attention module of the loaded model at its fw layer (a plain attribute, not a
        submodule, so the layer is listed once, under `attention`)."""
        for name, module in _attention_modules(self.hf):
            layer = self.attention[name.replace(".", "/")]
            module.__dict__["_fw_binding"] = _Binding(layer, self.step, self.ctx, self.settings[name])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """All sequences of the step as one [1, T] sequence; attention separates them by fw's metadata."""
        self.step.meta = meta
        try:
            out = self.hf.base_model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False)
        finally:
            self.step.meta = None
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The HF causal LM's own forward from the head on: its base model is swapped, for this call,
        for one that returns `hidden`, so soft-capping or scaling after the head applies as in HF."""
        base = getattr(self.hf, self.prefix)
        setattr(self.hf, self.prefix, _GivenHidden(hidden[None]))
        try:
            dummy = torch.zeros(1, hidden.shape[0], dtype=torch.long, device=hidden.device)
            logits = self.hf(input_ids=dummy, use_cache=False).logits
        finally:
            setattr(self.hf, self.prefix, base)
        return logits[0]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """transformers loads the checkpoint's tensors by its own names and conversion rules."""
        from transformers.utils import logging as hf_logging  # here: as above

        state = dict(weights)  # memory-mapped tensors; transformers copies them into the model
        bar = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # fw logs its own loading; no second progress bar
        try:
            hf, info = self.cls.from_pretrained(None, config=copy.deepcopy(self.config), state_dict=state,
                                                attn_implementation=ATTN_IMPLEMENTATION, dtype=self.ctx.dtype,
                                                output_loading_info=True)
        finally:
            if bar:
                hf_logging.enable_progress_bar()
        missing = sorted(info.get("missing_keys") or ())
        mismatched = info.get("mismatched_keys") or ()
        if missing or mismatched:
            what = ", ".join([*missing[:3], *(str(m) for m in list(mismatched)[:3])])
            raise ModelLoadError(f"transformers' {self.cls.__name__} could not load the checkpoint: "
                                 f"{len(missing)} weights missing, {len(mismatched)} of the wrong shape ({what})")
        self.hf = hf.eval()
        self._bind()
        return {f"hf.{name}" for name, _ in self.hf.named_parameters()}


def build(hf_config, ctx: ModelContext, max_positions: int | None = None) -> TransformersCausalLM:
    return TransformersCausalLM(hf_config, ctx)


@hookimpl
def fw_register_architectures(register) -> None:
    register(ArchitectureSpec(
        name="transformers",
        hf_architectures=(),
        build=build,
        fallback=True,
        rejection_reason=rejection_reason,
        description="any decoder-only causal LM transformers implements, run by its modelling code over fw's "
                    "paged KV cache and attention backend (--model-impl transformers, or auto without a native "
                    "plugin)",
    ))
