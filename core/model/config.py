"""`ModelConfig`: a model's hyper-parameters, read once from its Hugging Face config.

The raw transformers config names one thing several ways (`rms_norm_eps`, `layer_norm_eps`;
`hidden_act`, `hidden_activation`; `rope_theta` at the top level or inside `rope_parameters`)
and leaves some fields out, which `getattr(config, name, default)` turns into a silent default.
This module reads every field fw's layers and architectures use, in one place, applying each
documented default here (`DEFAULTS`) and refusing a config that lacks a field without one. GGUF
files reach it the same way: fw.model turns their metadata into a transformers config
first. Layers and architectures read a `ModelConfig`, never the raw config (a test greps for it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Iterator, Mapping

from fw.errors import ModelLoadError

# Fields every model states: no default is safe.
REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")

# What a field is when the config does not state it (docs/plugin-authors.md, "ModelConfig").
DEFAULTS: Mapping[str, str] = MappingProxyType({
    "num_key_value_heads": "num_attention_heads (no grouped-query attention)",
    "head_dim": "hidden_size // num_attention_heads",
    "rope.theta": "10000.0 (transformers' default base)",
    "rope.rope_type": "'default'",
    "rope.partial_rotary_factor": "1.0 (every dimension rotates)",
    "attention_bias, mlp_bias, use_bidirectional_attention": "False",
    "position_embedding_type": "'absolute'",
    "moe.decoder_sparse_step": "1 (every layer sparse)",
    "moe.mlp_only_layers": "() (no dense layers)",
    "moe.norm_topk_prob": "False",
    "everything else": "None (not stated; `require` refuses it where a model needs it)",
})

# The names transformers configs give the norm epsilon, in the order they are read.
_NORM_EPS_KEYS = ("rms_norm_eps", "layer_norm_eps", "norm_eps", "layer_norm_epsilon")


class FrozenMapping(Mapping[str, Any]):
    """A read-only dict that, unlike `types.MappingProxyType`, pickles and deep-copies (a model that
    holds its config can be saved or copied whole)."""

    def __init__(self, data: Mapping[str, Any] | None = None):
        self._data = dict(data or {})

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return repr(self._data)


@dataclass(frozen=True)
class RopeConfig:
    """One rotary embedding: transformers 5's `rope_parameters` for it, with the theta and partial
    rotary factor resolved. `parameters` (the whole dict, `rope_theta` included) is what
    transformers' initialisers read for the scaled types (linear, llama3, yarn, ...)."""

    rope_type: str = "default"
    theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    parameters: Mapping[str, Any] = field(default_factory=FrozenMapping, compare=False)
    max_position_embeddings: int | None = None  # the model's; scaled types compare against it


@dataclass(frozen=True)
class MoeConfig:
    """A sparse Mixture of Experts: `num_experts` SwiGLU experts of `intermediate_size`, the top
    `num_experts_per_tok` per token; layer i is sparse when i is not in `mlp_only_layers` and
    (i + 1) is a multiple of `decoder_sparse_step` (Qwen-MoE; Mixtral leaves both at their defaults)."""

    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int  # per expert: `moe_intermediate_size`, else `intermediate_size` (Mixtral)
    shared_expert_intermediate_size: int | None = None
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def is_sparse(self, layer: int) -> bool:
        """transformers' rule for which layers get experts."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


@dataclass(frozen=True)
class ModelConfig:
    """A model's hyper-parameters as fw's layers read them. Build it with `from_hf`.

    Field names follow transformers' where one name is standard; `norm_eps`, `hidden_act`, `rope`
    and `moe` gather the spellings and nested dicts families use. `raw` is config.json's values as
    a read-only dict, for a plugin's own keys."""

    name: str  # the model, for messages: its path or architecture
    architectures: tuple[str, ...]
    model_type: str | None
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int | None = None
    hidden_act: str | None = None
    norm_eps: float | None = None
    max_position_embeddings: int | None = None
    tie_word_embeddings: bool | None = None  # None: not stated; the family's convention applies
    attention_bias: bool = False
    mlp_bias: bool = False
    qkv_bias: bool | None = None  # Qwen2-MoE's flag (None: not stated)
    rope: RopeConfig = field(default_factory=RopeConfig)
    layer_ropes: Mapping[str, RopeConfig] = field(default_factory=FrozenMapping)  # per layer type (Gemma 3)
    layer_types: tuple[str, ...] | None = None  # "full_attention" / "sliding_attention" per layer
    sliding_window: int | None = None
    use_sliding_window: bool | None = None  # None: not stated
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    query_pre_attn_scalar: float | None = None
    use_bidirectional_attention: bool = False
    position_embedding_type: str = "absolute"
    type_vocab_size: int | None = None
    moe: MoeConfig | None = None
    raw: Mapping[str, Any] = field(default_factory=FrozenMapping, compare=False, repr=False)

    @classmethod
    def from_hf(cls, hf: Any, name: str | None = None) -> ModelConfig:
        """Read a transformers config object (also one fw made from GGUF metadata)."""
        if isinstance(hf, ModelConfig):
            return hf
        raw = _as_dict(hf)
        architectures = tuple(_read(hf, "architectures") or ())
        model_type = _read(hf, "model_type")
        name = name or _read(hf, "_name_or_path") or (architectures[0] if architectures else model_type) or "model"
        missing = [key for key in REQUIRED if _read(hf, key) is None]
        if missing:
            raise ModelLoadError(f"{name}: the model config lacks {', '.join(missing)}, which fw needs to build "
                                 f"the model and cannot default; add it to config.json")
        hidden, heads = int(_read(hf, "hidden_size")), int(_read(hf, "num_attention_heads"))
        head_dim = _read(hf, "head_dim")
        if head_dim is None and hidden % heads:
            raise ModelLoadError(f"{name}: hidden_size {hidden} does not divide into {heads} attention heads and "
                                 f"the config states no head_dim; add head_dim to config.json")
        max_positions = _optional(int, _read(hf, "max_position_embeddings"))
        rope, layer_ropes = _ropes(hf, max_positions)
        layer_types = _read(hf, "layer_types")
        return cls(
            name=str(name),
            architectures=architectures,
            model_type=model_type,
            vocab_size=int(_read(hf, "vocab_size")),
            hidden_size=hidden,
            num_hidden_layers=int(_read(hf, "num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=int(_read(hf, "num_key_value_heads") or heads),
            head_dim=int(head_dim or hidden // heads),
            intermediate_size=_optional(int, _read(hf, "intermediate_size")),
            hidden_act=_read(hf, "hidden_activation") or _read(hf, "hidden_act"),
            norm_eps=_optional(float, next((v for v in map(lambda k: _read(hf, k), _NORM_EPS_KEYS)
                                            if v is not None), None)),
            max_position_embeddings=max_positions,
            tie_word_embeddings=_optional(bool, _read(hf, "tie_word_embeddings")),
            attention_bias=bool(_read(hf, "attention_bias") or False),
            mlp_bias=bool(_read(hf, "mlp_bias") or False),
            qkv_bias=_optional(bool, _read(hf, "qkv_bias")),
            rope=rope,
            layer_ropes=FrozenMapping(layer_ropes),
            layer_types=None if layer_types is None else tuple(layer_types),
            sliding_window=_optional(int, _read(hf, "sliding_window") or None),
            use_sliding_window=_optional(bool, _read(hf, "use_sliding_window")),
            attn_logit_softcapping=_optional(float, _read(hf, "attn_logit_softcapping") or None),
            final_logit_softcapping=_optional(float, _read(hf, "final_logit_softcapping") or None),
            query_pre_attn_scalar=_optional(float, _read(hf, "query_pre_attn_scalar")),
            use_bidirectional_attention=bool(_read(hf, "use_bidirectional_attention") or False),
            position_embedding_type=_read(hf, "position_embedding_type") or "absolute",
            type_vocab_size=_optional(int, _read(hf, "type_vocab_size")),
            moe=_moe(hf),
            raw=FrozenMapping(raw),
        )

    def require(self, *fields: str) -> ModelConfig:
        """`self`, or a ModelLoadError naming the fields (of those given) the config does not state."""
        missing = [f for f in fields if getattr(self, f) is None]
        if missing:
            raise ModelLoadError(f"{self.name}: the model config lacks {', '.join(missing)}, which this "
                                 f"architecture needs and fw does not default; add it to config.json")
        return self

    def rope_for(self, layer_type: str) -> RopeConfig:
        """The rotary embedding of one layer type (Gemma 3 keys them), else the model's one."""
        return self.layer_ropes.get(layer_type, self.rope)

    def layer_types_checked(self, allowed: tuple[str, ...] = ("full_attention", "sliding_attention"),
                            ) -> tuple[str, ...]:
        """`layer_types`, checked: one per layer, each one of `allowed`."""
        types = self.layer_types
        if types is None:
            raise ModelLoadError(f"{self.name}: config.json states no layer_types")
        if len(types) != self.num_hidden_layers:
            raise ModelLoadError(f"config.json: layer_types lists {len(types)} layers, the model has "
                                 f"{self.num_hidden_layers}")
        unknown = set(types) - set(allowed)
        if unknown:
            raise ModelLoadError(f"config.json: unknown layer types {sorted(unknown)} (this architecture has "
                                 f"{' and '.join(allowed)})")
        return types


def as_model_config(config: Any) -> ModelConfig:
    """A `ModelConfig` as is; a transformers config read into one (what plugins written before
    plugin API 1.5 hand the shared layers)."""
    return config if isinstance(config, ModelConfig) else ModelConfig.from_hf(config)


def _read(hf: Any, key: str) -> Any:
    """One attribute of the transformers config, None when absent: the only place that reads it."""
    return getattr(hf, key, None)


def _optional(kind: type, value: Any) -> Any:
    return None if value is None else kind(value)


def _as_dict(hf: Any) -> dict[str, Any]:
    if isinstance(hf, Mapping):
        return dict(hf)
    to_dict = getattr(hf, "to_dict", None)
    return dict(to_dict()) if callable(to_dict) else dict(vars(hf))


def _rope_from(params: Mapping[str, Any], hf: Any, max_positions: int | None) -> RopeConfig:
    params = dict(params)
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", _read(hf, "rope_theta"))
    theta = 10000.0 if theta is None else float(theta)
    partial = params.get("partial_rotary_factor", _read(hf, "partial_rotary_factor"))
    partial = 1.0 if partial is None else float(partial)
    params.update(rope_type=rope_type, rope_theta=theta)
    return RopeConfig(rope_type, theta, partial, FrozenMapping(params), max_positions)


def _ropes(hf: Any, max_positions: int | None) -> tuple[RopeConfig, dict[str, RopeConfig]]:
    """transformers 5 keeps the base in `rope_parameters` (a reader of the old top-level `rope_theta`
    alone silently gets 10000); older configs state `rope_theta` and `rope_scaling`. Gemma 3 keys
    `rope_parameters` by layer type."""
    params = _read(hf, "rope_parameters")
    if params is None:
        params = _read(hf, "rope_scaling") or {}
    if params and all(isinstance(v, Mapping) for v in params.values()):
        by_type = {t: _rope_from(p, hf, max_positions) for t, p in params.items()}
        main = by_type.get("full_attention") or next(iter(by_type.values()))
        return main, by_type
    return _rope_from(params, hf, max_positions), {}


def _moe(hf: Any) -> MoeConfig | None:
    experts = _read(hf, "num_local_experts") or _read(hf, "num_experts")
    if not experts:
        return None
    size = _read(hf, "moe_intermediate_size") or _read(hf, "intermediate_size")
    top_k = _read(hf, "num_experts_per_tok")
    if size is None or top_k is None:
        what = "num_experts_per_tok" if top_k is None else "moe_intermediate_size"
        raise ModelLoadError(f"the model config names {experts} experts but no {what}; add it to config.json")
    return MoeConfig(
        num_experts=int(experts), num_experts_per_tok=int(top_k), intermediate_size=int(size),
        shared_expert_intermediate_size=_optional(int, _read(hf, "shared_expert_intermediate_size") or None),
        norm_topk_prob=bool(_read(hf, "norm_topk_prob") or False),
        decoder_sparse_step=int(_read(hf, "decoder_sparse_step") or 1),
        mlp_only_layers=tuple(_read(hf, "mlp_only_layers") or ()),
    )
