"""`fw plugins new --kind architecture --hf-class X`: read what transformers' class X is made of and
say how fw's building blocks express it, or refuse naming what they cannot.

A tiny instance of X (its own config class, a few layers of width 32) is built and its module tree
read: the layer's norm placement (pre-norm, or OLMo 2's post-norm), the q/k norm's width, the
projection biases, the MLP's activation and the norm's rounding order (found by running the norm
in bf16 against fw's `RMSNorm` both ways). Nothing is invented: the config is transformers' own
class, and what the tree does not show (code inside `forward`) is caught by the generated test,
which compares the plugin with transformers' X on random weights."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import transformers

from fw.errors import ConfigError
from fw.layers.blocks import ACTIVATIONS
from fw.layers.norm import ROUNDINGS, RMSNorm

PRE_NORM = frozenset({"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"})
POST_NORM = frozenset({"self_attn", "post_attention_layernorm", "mlp", "post_feedforward_layernorm"})
ATTENTION = frozenset({"q_proj", "k_proj", "v_proj", "o_proj"})
MLP = frozenset({"gate_proj", "up_proj", "down_proj"})
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
# config fields that switch on what fw's generated layer does not do
UNPORTED_FIELDS = ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar", "num_experts",
                   "num_local_experts")


@dataclass(frozen=True)
class Port:
    """How fw's blocks express transformers' `hf_class` (what the architecture templates render)."""

    hf_class: str
    config_class: str
    model_type: str
    layer: str  # "pre_norm" | "post_norm"
    qk_norm: str | None  # None | "head" | "full"
    rounding: str  # fw.layers.RMSNorm rounding of the model's norms
    qkv_bias: str  # a Python expression over `cfg` (the config's own field when it has one)
    o_bias: str
    mlp_bias: str

    def summary(self) -> str:
        layer = "post-norm layers (norm after attention and after the MLP, then the residual add)" \
            if self.layer == "post_norm" else "pre-norm layers"
        qk = {None: "no q/k norm", "head": "a q/k RMSNorm per head",
              "full": "a q/k RMSNorm over all heads at once"}[self.qk_norm]
        return f"{layer}, {qk}, RMSNorm rounding {self.rounding!r}"


def inspect_hf_class(hf_class: str) -> Port:
    """The Port for transformers' `hf_class`, or ConfigError saying what fw's blocks do not cover."""
    cls = getattr(transformers, hf_class, None)
    if cls is None or not hf_class.endswith("ForCausalLM"):
        raise ConfigError(f"--hf-class {hf_class!r}: not a causal-LM class of transformers "
                          f"{transformers.__version__} (name one ending ForCausalLM, as config.json \"architectures\" "
                          f"does, e.g. Olmo2ForCausalLM)")
    config_cls = cls.config_class

    def refuse(why: str) -> ConfigError:
        return ConfigError(f"--hf-class {hf_class}: {why}; fw's building blocks do not express it, so the scaffold "
                           f"will not claim {hf_class} with a body that computes something else. Write the model "
                           f"yourself (docs/plugin-authors/blocks.md) from `fw plugins new --kind architecture NAME`")

    try:
        config = config_cls(**TINY)
        with torch.device("cpu"):
            model = cls(config).eval()
    except Exception as exc:  # an unusual config class: say so rather than guess
        raise refuse(f"a tiny {config_cls.__name__}({TINY}) did not build ({exc})") from exc
    for field in UNPORTED_FIELDS:
        if getattr(config, field, None) not in (None, False, 0):
            raise refuse(f"its config sets {field}")
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
        raise refuse("it has sliding-window layers")
    base = getattr(model, "model", None)
    children = _children(base)
    if base is None or children - {"embed_tokens", "layers", "norm", "rotary_emb"}:
        raise refuse(f"its backbone holds {sorted(children)} (fw's DecoderModel: embed_tokens, layers, norm)")
    if type(base.embed_tokens) is not torch.nn.Embedding:
        raise refuse(f"its embedding is a {type(base.embed_tokens).__name__}, not a plain torch Embedding")
    layer = base.layers[0]
    names = _children(layer)
    if names not in (PRE_NORM, POST_NORM):
        raise refuse(f"its decoder layer holds {sorted(names)}; fw has pre-norm ({sorted(PRE_NORM)}) and post-norm "
                     f"({sorted(POST_NORM)}) layers")
    attn, mlp = layer.self_attn, layer.mlp
    extra = _children(attn) - ATTENTION - {"q_norm", "k_norm"}
    if extra or not ATTENTION <= _children(attn):
        raise refuse(f"its attention holds {sorted(_children(attn))}")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if abs(float(getattr(attn, "scaling", head_dim ** -0.5)) - head_dim ** -0.5) > 1e-9:
        raise refuse(f"its attention scale is {attn.scaling}, not 1/sqrt(head_dim)")
    qk_norm = None
    if hasattr(attn, "q_norm"):
        width = attn.q_norm.weight.numel()
        qk_norm = "head" if width == head_dim else "full" if width == config.num_attention_heads * head_dim else None
        if qk_norm is None:
            raise refuse(f"its q norm is {width} wide (neither head_dim nor all heads)")
    if _children(mlp) - {"act_fn"} != MLP or getattr(config, "hidden_act", None) not in _activations():
        raise refuse(f"its MLP holds {sorted(_children(mlp))} with activation {getattr(config, 'hidden_act', None)!r}")
    norms = [base.norm, layer.post_attention_layernorm] + ([attn.q_norm] if qk_norm else [])
    roundings = {_rounding(n, refuse) for n in norms}
    if len(roundings) != 1:
        raise refuse(f"its norms round in different orders ({sorted(roundings)})")
    return Port(hf_class=hf_class, config_class=config_cls.__name__, model_type=config.model_type,
                layer="post_norm" if names == POST_NORM else "pre_norm", qk_norm=qk_norm, rounding=roundings.pop(),
                qkv_bias=_bias(config, attn.q_proj), o_bias=_bias(config, attn.o_proj),
                mlp_bias=_bias(config, mlp.gate_proj, field="mlp_bias"))


def _children(module: Any) -> frozenset[str]:
    return frozenset(name for name, _ in module.named_children()) if module is not None else frozenset()


def _activations() -> tuple[str, ...]:
    return tuple(ACTIVATIONS)


def _bias(config: Any, linear: Any, field: str = "attention_bias") -> str:
    """`cfg.<field>` when the config has the field and it agrees with the built layer, else the literal."""
    has = linear.bias is not None
    if isinstance(getattr(config, field, None), bool) and getattr(config, field) == has:
        return f"cfg.{field}"
    return repr(has)


def _rounding(norm: Any, refuse) -> str:
    """Which fw RMSNorm rounding reproduces transformers' `norm` in bf16: the two orders differ in a
    large share of outputs, fw's normalisation from HF's five-op form in a few last places."""
    if getattr(norm, "weight", None) is None:
        raise refuse(f"its {type(norm).__name__} has no weight (fw's norm is RMSNorm)")
    width = norm.weight.numel()
    gen = torch.Generator().manual_seed(0)
    weight = 1 + torch.randn(width, generator=gen) * 0.5
    x = (torch.randn(64, width, generator=gen) * 3).to(torch.bfloat16)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
    with torch.no_grad():
        norm = norm.to(torch.bfloat16)
        norm.weight.copy_(weight)
        want = norm(x)
        for rounding in ROUNDINGS:
            ours = RMSNorm(width, eps, torch.bfloat16, rounding=rounding)
            ours.weight.copy_(weight)
            ours.fused_ok = False  # torch's path: the definition, not a kernel
            if (ours(x) != want).float().mean() < 0.01:
                return rounding
    raise refuse(f"its {type(norm).__name__} matches neither RMSNorm rounding order in bf16")
