"""Descriptions of implementations, one dataclass per plugin kind.

Specs are plain data plus a factory, so listing plugins never builds anything
heavy. Each spec says what it supports; `rejection_reasons` turns a request
into the list of reasons it cannot serve it (empty: it can).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal, Protocol, Sequence

if TYPE_CHECKING:  # annotations only: listing plugins imports neither torch nor transformers
    import argparse

    import torch
    from torch import nn
    from transformers import PretrainedConfig

    from fw.grammar.contract import GrammarCompiler
    from fw.grammar.tokenizer import GrammarTokenizer
    from fw.layers.attention import AttentionBackend
    from fw.layers.context import ModelContext
    from fw.layers.linear import LinearMethod
    from fw.layers.moe import MoeKernel
    from fw.model.config import ModelConfig
    from fw.sampling.batch import SamplingBatch
    from fw.sampling.params import SamplingParams
    from fw.plugins.executor import Executor
    from fw.speculative.contract import Proposer, ProposerContext
    from fw.tool_parsing import ToolParser

KINDS = ("architecture", "attention_backend", "moe_kernel", "quantization_method", "sampler", "grammar_backend",
         "tool_parser", "cli_command", "proposer", "executor")


def _device_and_dtype_reasons(spec, req) -> list[str]:
    """The reasons shared by every selectable kind: the device and dtype it does not support."""
    reasons = []
    if req.device not in spec.devices:
        reasons.append(f"device {req.device!r} not supported (supports {', '.join(spec.devices)})")
    if req.dtype not in spec.dtypes:
        reasons.append(f"dtype {req.dtype} not supported (supports {', '.join(spec.dtypes)})")
    return reasons


def _capability_reasons(needs: dict[str, tuple[int, int]] | None, what: str, value: str,
                        capability: tuple[int, int] | None) -> list[str]:
    """Why `value` (a dtype, a KV-cache dtype) cannot run on a GPU of compute capability `capability`
    when the spec declares `needs[value]` as the lowest one it compiles for. Unknown capability: no reason."""
    need = (needs or {}).get(value)
    if need is None or capability is None or tuple(capability) >= tuple(need):
        return []
    return [f"{what} {value} needs CUDA compute capability {need[0]}.{need[1]} or newer "
            f"(sm_{need[0]}{need[1]}); this GPU is {capability[0]}.{capability[1]}"]


def _capability_summary(needs: dict[str, tuple[int, int]] | None, key: str) -> dict:
    return {key: {name: f"{c[0]}.{c[1]}" for name, c in needs.items()}} if needs else {}


def _availability_reasons(spec) -> list[str]:
    """What the spec's `available()` says against running in this process (a missing package, no GPU)."""
    why = spec.available() if spec.available is not None else None
    return [why] if why else []


@dataclass(frozen=True)
class Verified:
    """A device kind an implementation has been verified on: its GPU-marked tests (or, for `cpu`, its
    CPU tests) passed there. Specs list them in `verified_on`; on a GPU `auto` prefers implementations
    verified on that GPU's kind, and naming an unverified one works with one warning.

    `capability` is the CUDA compute capability ((9, 0) for sm_90: H100, H200); None stands for every
    device of `device` (the CPU). `gpu`, `date` (ISO) and `by` (what ran) say where the claim comes from."""

    device: str
    capability: tuple[int, int] | None = None
    gpu: str = ""
    date: str = ""
    by: str = ""

    def covers(self, device: str, capability: tuple[int, int] | None = None) -> bool:
        """True for a device of this kind. A device whose capability is unknown matches on its type."""
        if device != self.device:
            return False
        return self.capability is None or capability is None or tuple(capability) == tuple(self.capability)

    def __str__(self) -> str:
        kind = self.device + (f" sm_{self.capability[0]}{self.capability[1]}" if self.capability else "")
        where = ", ".join(x for x in (self.gpu, self.date, self.by) if x)
        return f"{kind} ({where})" if where else kind


def verification(spec: Any, device: str, capability: tuple[int, int] | None = None) -> Verified | None:
    """The first of `spec.verified_on` that covers the device, or None (also for specs without the field)."""
    return next((v for v in getattr(spec, "verified_on", ()) if v.covers(device, capability)), None)


class ArchitectureBuild(Protocol):
    """`ArchitectureSpec.build`: the model for `config` (a `fw.model.config.ModelConfig` when the spec
    says `build_config="model"`, else the transformers config), with `ctx`'s dtype, device, attention
    backend and linear method, and rotary tables for `max_positions` (None: the model's own maximum)."""

    def __call__(self, config: ModelConfig | PretrainedConfig, ctx: ModelContext,
                 max_positions: int | None = None, /) -> nn.Module: ...


class SamplerStage(Protocol):
    """A `SamplerSpec` stage: `apply` runs on the batch when `is_active` holds for some row's params."""

    def is_active(self, params: SamplingParams, /) -> bool: ...

    def apply(self, logits: torch.Tensor, batch: SamplingBatch, /) -> torch.Tensor: ...


class PerRequestSamplerStage(Protocol):
    """A `per_request` stage: `apply` gets only the rows whose request names it, with each row's
    arguments (what the optional `prepare(params, tokenizer)` returned, else the parameters)."""

    def apply(self, logits: torch.Tensor, batch: SamplingBatch, args: Sequence[Any], /) -> torch.Tensor: ...


class SamplerChoice(Protocol):
    """A `SamplerSpec` with role "choice": the final token per row."""

    def choose(self, logits: torch.Tensor, batch: SamplingBatch, /) -> torch.Tensor: ...


@dataclass(frozen=True)
class ArchitectureSpec:
    """A model family. `build(config, ctx, max_positions)` (`ArchitectureBuild`) returns an `nn.Module`
    with ``forward(input_ids, positions, attn_meta) -> hidden``, ``compute_logits(hidden)`` and
    ``load_weights(iterable of (name, tensor))``.

    `build_config` says what `build` receives: "hf", the transformers config object (what plugins
    written before plugin API 1.5 get), or "model", fw's `ModelConfig`, the config read once, with
    its defaults applied and its missing fields refused (docs/plugin-authors/architectures.md)."""

    name: str
    hf_architectures: tuple[str, ...]
    build: ArchitectureBuild
    gguf_architectures: tuple[str, ...] = ()
    # Quantization methods are `LinearMethod`s, so a model built from `fw.layers.Linear` takes all of
    # them: None (the default) accepts every installed method; a tuple opts out of the rest (() accepts
    # none). Weights outside `Linear` (stacked MoE experts) stay in the model dtype whatever the method;
    # a checkpoint that ships them quantized is refused by the loader (fw.model.quantized_weights).
    supported_quantization: tuple[str, ...] | None = None
    # (hf_name, tensor, hf_config) -> tensor, for GGUF files whose layout differs from HF's
    gguf_weight_transform: Callable[[str, torch.Tensor, PretrainedConfig], torch.Tensor] | None = None
    description: str = ""
    # A fallback serves models by their config rather than by name: `--model-impl auto` uses it when no
    # native spec claims the model, `--model-impl transformers` always. Its `hf_architectures` may be
    # empty; `rejection_reason(hf_config)` returns None when it can run the model, else why not.
    fallback: bool = False
    rejection_reason: Callable[[PretrainedConfig], str | None] | None = None
    # What the model is for. "generate": a causal LM over the paged KV cache, `forward` + `compute_logits`
    # (it also embeds with --task embed, its hidden states pooled). "embed": an encoder without KV cache
    # (bidirectional attention; `forward(input_ids, positions, fw.layers.EncoderMetadata)` -> hidden states,
    # no `compute_logits`), run by fw.pooling's encoder engine for embeddings only (docs/embeddings.md).
    task: Literal["generate", "embed"] = "generate"
    # How hidden states become one vector when the checkpoint does not say (no sentence-transformers
    # 1_Pooling/config.json) and --pooling is auto: "last" (token), "mean", "cls" (first token) or "max".
    default_pooling: str = "last"
    # What `build` receives: "hf" (the transformers config) or "model" (fw.model.config.ModelConfig).
    build_config: Literal["hf", "model"] = "hf"
    kind = "architecture"

    def __post_init__(self) -> None:
        if self.build_config not in ("hf", "model"):
            raise ValueError(f"architecture {self.name!r}: build_config must be 'hf' or 'model', "
                             f"not {self.build_config!r}")

    def summary(self) -> dict:
        return {
            "hf_architectures": list(self.hf_architectures),
            "gguf_architectures": list(self.gguf_architectures),
            "supported_quantization": (None if self.supported_quantization is None
                                       else list(self.supported_quantization)),
            "fallback": self.fallback,
            "task": self.task,
        }


@dataclass(frozen=True)
class AttentionRequirements:
    """What the model and engine need from an attention backend."""

    device: str
    dtype: str
    head_size: int
    page_size: int
    sliding_window: int | None = None
    logit_softcap: float | None = None
    # --kv-cache-dtype: "auto" when the cache holds K/V in the model dtype, else e.g. "fp8_e4m3"
    kv_cache_dtype: str = "auto"
    # The GPU's CUDA compute capability, (9, 0) for sm_90; None on the CPU (or when unknown)
    capability: tuple[int, int] | None = None


@dataclass(frozen=True)
class AttentionBackendSpec:
    """An attention backend. `backend_cls` implements `fw.layers.attention.AttentionBackend`.

    `available` is called at selection time and returns None, or the reason the
    backend cannot run in this process (a missing package, no GPU, ...)."""

    name: str
    backend_cls: type[AttentionBackend]
    devices: tuple[str, ...] = ("cpu", "cuda")
    dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
    head_sizes: tuple[int, ...] | None = None
    page_sizes: tuple[int, ...] | None = None
    supports_sliding_window: bool = False
    supports_logit_softcap: bool = False
    # KV-cache dtypes (--kv-cache-dtype names) it reads and writes; "auto" is the model dtype. A backend
    # listing fp8 ones quantizes K/V on write with its layer's `k_scale`/`v_scale` and dequantizes on read.
    kv_cache_dtypes: tuple[str, ...] = ("auto",)
    priority: int = 0
    available: Callable[[], str | None] | None = None
    description: str = ""
    # Auto's rank on a device listed here (e.g. {"cpu": -10, "cuda": 20}); `priority` elsewhere. A backend
    # can be fastest on one device and slow on another: the reference `sdpa` stays 0 on both. Last, so
    # positional arguments of existing specs keep their meaning.
    priority_by_device: dict[str, int] | None = field(default=None, hash=False)
    # The lowest CUDA compute capability each model dtype / KV-cache dtype needs (e.g. {"bfloat16": (8, 0)}
    # for Triton's bf16 dot, {"fp8_e4m3": (8, 9)}); unlisted ones run on any GPU the backend runs on.
    dtype_min_capability: dict[str, tuple[int, int]] | None = field(default=None, hash=False)
    kv_cache_dtype_min_capability: dict[str, tuple[int, int]] | None = field(default=None, hash=False)
    # The device kinds its tests passed on (`Verified`); on a GPU auto prefers verified backends.
    verified_on: tuple[Verified, ...] = ()
    kind = "attention_backend"

    def priority_on(self, device: str) -> int:
        """The priority auto ranks this backend by on `device`."""
        return (self.priority_by_device or {}).get(device, self.priority)

    def rejection_reasons(self, req: AttentionRequirements) -> list[str]:
        reasons = _device_and_dtype_reasons(self, req)
        if self.head_sizes is not None and req.head_size not in self.head_sizes:
            reasons.append(f"head size {req.head_size} not supported (supports {list(self.head_sizes)})")
        if self.page_sizes is not None and req.page_size not in self.page_sizes:
            reasons.append(f"KV page size {req.page_size} not supported (supports {list(self.page_sizes)})")
        if req.sliding_window and not self.supports_sliding_window:
            reasons.append("sliding-window attention not supported")
        if req.logit_softcap and not self.supports_logit_softcap:
            reasons.append("attention logit soft-capping not supported")
        if req.kv_cache_dtype not in self.kv_cache_dtypes:
            reasons.append(f"KV cache dtype {req.kv_cache_dtype} not supported "
                           f"(supports {', '.join(self.kv_cache_dtypes)})")
        if req.device == "cuda":
            reasons += _capability_reasons(self.dtype_min_capability, "dtype", req.dtype, req.capability)
            reasons += _capability_reasons(self.kv_cache_dtype_min_capability, "KV cache dtype",
                                           req.kv_cache_dtype, req.capability)
        return reasons + _availability_reasons(self)

    def summary(self) -> dict:
        return {
            "devices": list(self.devices),
            "dtypes": list(self.dtypes),
            "head_sizes": None if self.head_sizes is None else list(self.head_sizes),
            "page_sizes": None if self.page_sizes is None else list(self.page_sizes),
            "sliding_window": self.supports_sliding_window,
            "logit_softcap": self.supports_logit_softcap,
            "kv_cache_dtypes": list(self.kv_cache_dtypes),
            "priority": self.priority,
            **({"priority_by_device": dict(self.priority_by_device)} if self.priority_by_device else {}),
            **_capability_summary(self.dtype_min_capability, "dtype_min_capability"),
            **_capability_summary(self.kv_cache_dtype_min_capability, "kv_cache_dtype_min_capability"),
            "verified_on": [str(v) for v in self.verified_on],
        }


@dataclass(frozen=True)
class MoeRequirements:
    """What a Mixture-of-Experts layer needs from the kernel that computes its experts."""

    device: str
    dtype: str
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    activation: str  # HF `hidden_act` name, e.g. "silu"
    # The GPU's CUDA compute capability, (9, 0) for sm_90; None on the CPU (or when unknown)
    capability: tuple[int, int] | None = None


@dataclass(frozen=True)
class MoeKernelSpec:
    """An expert-computation kernel for MoE layers. `kernel_cls()` returns an object with the
    `fw.layers.moe.MoeKernel` interface; one instance per MoE layer.

    `activations` None means any activation the layer supports; `available` is called at
    selection time and returns None, or why the kernel cannot run in this process."""

    name: str
    kernel_cls: Callable[[], MoeKernel]
    devices: tuple[str, ...] = ("cpu", "cuda")
    dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
    activations: tuple[str, ...] | None = None
    priority: int = 0
    available: Callable[[], str | None] | None = None
    description: str = ""
    # As for attention backends: the lowest CUDA compute capability per dtype, and where it was verified.
    dtype_min_capability: dict[str, tuple[int, int]] | None = field(default=None, hash=False)
    verified_on: tuple[Verified, ...] = ()
    kind = "moe_kernel"

    def rejection_reasons(self, req: MoeRequirements) -> list[str]:
        reasons = _device_and_dtype_reasons(self, req)
        if self.activations is not None and req.activation not in self.activations:
            reasons.append(f"activation {req.activation!r} not supported (supports {', '.join(self.activations)})")
        if req.device == "cuda":
            reasons += _capability_reasons(self.dtype_min_capability, "dtype", req.dtype, req.capability)
        return reasons + _availability_reasons(self)

    def summary(self) -> dict:
        return {
            "devices": list(self.devices),
            "dtypes": list(self.dtypes),
            "activations": None if self.activations is None else list(self.activations),
            "priority": self.priority,
            **_capability_summary(self.dtype_min_capability, "dtype_min_capability"),
            "verified_on": [str(v) for v in self.verified_on],
        }


@dataclass(frozen=True)
class QuantizationMethodSpec:
    """A quantization method. `factory(quant_config: dict)` returns an object with
    the `fw.layers.linear.LinearMethod` interface. `detects(quant_config)` says
    whether a checkpoint's `quantization_config` is in this method's format."""

    name: str
    factory: Callable[[dict], LinearMethod]
    detects: Callable[[dict], bool] | None = None
    devices: tuple[str, ...] = ("cpu", "cuda")
    available: Callable[[], str | None] | None = None
    description: str = ""
    # The device kinds its quantized matmuls were verified on (`Verified`); an unverified GPU gets a warning.
    verified_on: tuple[Verified, ...] = ()
    kind = "quantization_method"

    def summary(self) -> dict:
        return {"devices": list(self.devices), "verified_on": [str(v) for v in self.verified_on]}


@dataclass(frozen=True)
class SamplerSpec:
    """A sampler. kind="stage": `factory()` returns an object with
    ``is_active(params) -> bool`` and ``apply(logits, batch) -> logits``, run in
    ascending `order` for rows whose params activate it. kind="choice": the
    object has ``choose(logits, batch) -> token ids``; `--sampling-backend` picks one.

    A `per_request` stage runs only for the rows whose request names it in
    `SamplingParams.samplers`, with that row's parameters: its object has
    ``apply(logits, batch, args) -> logits`` over just those rows (`args[i]` for row i) and
    optionally ``prepare(params: dict, tokenizer) -> Any``, called once per request, whose result
    is what `apply` then gets (else the parameters themselves). `parameters` is the JSON schema
    (an object schema, checked with `jsonschema`) a request's parameters must satisfy; its
    top-level `default`s are filled in. A per-request stage without one takes no parameters."""

    name: str
    factory: Callable[[], SamplerStage | PerRequestSamplerStage | SamplerChoice]
    role: Literal["stage", "choice"] = "stage"
    order: int = 100
    description: str = ""
    per_request: bool = False
    parameters: dict[str, Any] | None = None
    kind = "sampler"

    def __post_init__(self) -> None:
        if self.per_request and self.role != "stage":
            raise ValueError(f"sampler {self.name!r}: only stages can be per_request, not a {self.role!r}")
        if self.parameters is None:
            return
        if not self.per_request:
            raise ValueError(f"sampler {self.name!r}: a parameters schema needs per_request=True (always-on "
                             "stages read their settings from SamplingParams fields)")
        if not isinstance(self.parameters, dict) or self.parameters.get("type") != "object":
            raise ValueError(f'sampler {self.name!r}: parameters must be a JSON schema with "type": "object"')
        import jsonschema  # only plugins that declare a schema pay for the import

        try:
            jsonschema.validators.validator_for(self.parameters, default=jsonschema.Draft202012Validator
                                                ).check_schema(self.parameters)
        except jsonschema.SchemaError as exc:
            raise ValueError(f"sampler {self.name!r}: parameters is not a valid JSON schema: {exc.message}") from None

    def summary(self) -> dict:
        out: dict[str, Any] = {"role": self.role, "order": self.order}
        if self.per_request:
            out.update(per_request=True, parameters=self.parameters)
        return out


@dataclass(frozen=True)
class GrammarBackendSpec:
    """A structured-output backend. `factory(tokenizer: fw.grammar.GrammarTokenizer)` returns a
    `fw.grammar.GrammarCompiler` of constraints into per-sequence matchers (the contract is in
    fw.grammar.contract). `constraint_kinds` are the `fw.grammar.CONSTRAINT_KINDS` it compiles;
    `auto` picks the highest `priority` that supports a request's kind and is `available`."""

    name: str
    factory: Callable[[GrammarTokenizer], GrammarCompiler]
    constraint_kinds: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice")
    priority: int = 0
    available: Callable[[], str | None] | None = None
    description: str = ""
    kind = "grammar_backend"

    def rejection_reasons(self, constraint_kind: str) -> list[str]:
        reasons = []
        if constraint_kind not in self.constraint_kinds:
            reasons.append(f"{constraint_kind} constraints not supported (supports {', '.join(self.constraint_kinds)})")
        return reasons + _availability_reasons(self)

    def summary(self) -> dict:
        return {"constraint_kinds": list(self.constraint_kinds), "priority": self.priority}


@dataclass(frozen=True)
class ToolParserSpec:
    """Extracts tool calls from generated text for chat requests with `tool_choice: "auto"`.
    `factory(tools: list[dict])` (the request's function definitions) returns a fresh
    `fw.tool_parsing.ToolParser` per generated choice. `--tool-call-parser NAME` picks one; `auto`
    picks the highest `priority` whose `detects(chat_template_text)` is true. `tool_prompt_format`
    tells a model whose template ignores tools how to write a call (fw adds it to the tool prompt)."""

    name: str
    factory: Callable[[list[dict]], ToolParser]
    detects: Callable[[str], bool] | None = None
    priority: int = 0
    tool_prompt_format: str = ""
    description: str = ""
    kind = "tool_parser"

    def summary(self) -> dict:
        return {"detects_template": self.detects is not None, "priority": self.priority}


@dataclass(frozen=True)
class CliCommandSpec:
    """A `fw <name>` subcommand: `configure(parser)` adds arguments, `run(args) -> exit code`."""

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    kind = "cli_command"

    def summary(self) -> dict:
        return {"help": self.help}


@dataclass(frozen=True)
class ProposerSpec:
    """A speculative-decoding proposer: drafts tokens that the target model then verifies
    (docs/speculative.md). `factory(args: dict, context: fw.speculative.ProposerContext)` returns a
    `fw.speculative.Proposer`; `--speculative-config`'s `method` names the spec. `args` are that
    configuration's keys other than fw's own (`method`, `num_speculative_tokens`, `disable_by_batch_size`,
    `min_acceptance_rate`), checked against `parameters` (a JSON schema with "type": "object", its
    top-level `default`s filled in); a spec without one takes no keys of its own. A factory may raise
    ValueError for a bad combination; fw reports it as a configuration error naming the flag."""

    name: str
    factory: Callable[[dict, ProposerContext], Proposer]
    parameters: dict[str, Any] | None = None
    description: str = ""
    kind = "proposer"

    def __post_init__(self) -> None:
        if self.parameters is None:
            return
        if not isinstance(self.parameters, dict) or self.parameters.get("type") != "object":
            raise ValueError(f'proposer {self.name!r}: parameters must be a JSON schema with "type": "object"')
        import jsonschema  # only plugins that declare a schema pay for the import

        try:
            jsonschema.validators.validator_for(self.parameters, default=jsonschema.Draft202012Validator
                                                ).check_schema(self.parameters)
        except jsonschema.SchemaError as exc:
            raise ValueError(f"proposer {self.name!r}: parameters is not a valid JSON schema: {exc.message}") from None

    def summary(self) -> dict:
        return {"parameters": self.parameters}


@dataclass(frozen=True)
class ExecutorSpec:
    """How the ranks of a --tensor-parallel-size engine start (docs/distributed.md, "Executors"):
    `factory()` returns a `fw.plugins.Executor`; `--distributed-executor-backend NAME` picks it
    (vLLM's flag). `max_world_size` is the most ranks it runs (1: in-process only; None: any);
    `multi_node` says it places ranks on other machines (or runs under a launcher that does);
    `starts_processes` is False when something else (a launcher) starts the ranks."""

    name: str
    factory: Callable[[], Executor]
    max_world_size: int | None = None
    multi_node: bool = False
    starts_processes: bool = True
    description: str = ""
    kind = "executor"

    def rejection_reasons(self, world_size: int, nnodes: int) -> list[str]:
        """Why it cannot run `world_size` ranks over `nnodes` machines (empty: it can)."""
        reasons = []
        if self.max_world_size is not None and world_size > self.max_world_size:
            reasons.append(f"runs at most {self.max_world_size} rank{'s' * (self.max_world_size != 1)}")
        if nnodes > 1 and not self.multi_node:
            reasons.append("runs ranks on one machine only")
        return reasons

    def summary(self) -> dict:
        return {"max_world_size": self.max_world_size, "multi_node": self.multi_node,
                "starts_processes": self.starts_processes}


Spec = (ArchitectureSpec | AttentionBackendSpec | MoeKernelSpec | QuantizationMethodSpec | SamplerSpec
        | GrammarBackendSpec | ToolParserSpec | CliCommandSpec | ProposerSpec | ExecutorSpec)


__all__ = [
    "KINDS",
    "ArchitectureBuild",
    "ArchitectureSpec",
    "AttentionBackendSpec",
    "AttentionRequirements",
    "MoeKernelSpec",
    "MoeRequirements",
    "QuantizationMethodSpec",
    "SamplerSpec",
    "GrammarBackendSpec",
    "ToolParserSpec",
    "CliCommandSpec",
    "ProposerSpec",
    "ExecutorSpec",
    "SamplerChoice",
    "SamplerStage",
    "PerRequestSamplerStage",
    "Verified",
    "verification",
]
