"""Engine configuration: one typed dataclass from which CLI flags, `FW_*`
environment variables and YAML `--config` keys are derived.

Precedence, lowest to highest: defaults < YAML file < environment < CLI.
A field's flag is its name with dashes (`max_batch_size` -> `--max-batch-size`),
its variable is `FW_` + the upper-cased name (`FW_MAX_BATCH_SIZE`). A field may also
answer to the name another system (vLLM, SGLang, TGI, MAX) gives the same option
(`aliases`, or `negated_aliases` for a switch that means `--no-<flag>`): CLI flags only,
listed in docs/flags.md with the system each mirrors.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fw import env
from fw.errors import ConfigError
from fw.speculative.config import SpeculativeConfig


def _opt(help: str, **extra: Any) -> dict:
    """A field's metadata: its help, and optionally `choices`, `repeatable`, `aliases` and `negated_aliases`
    (each a tuple of (flag, the system whose name it is))."""
    return {"help": help, **extra}


# The default step budget. On a CPU a step of 2,048 prompt tokens held every decoding stream for its whole
# prefill; 512 cut that stall at the same throughput (docs/performance.md, "Prefill beside decode on CPU").
GPU_STEP_TOKENS = 2048
CPU_STEP_TOKENS = 512

MODEL_IMPLS = ("auto", "fw", "transformers")
TASKS = ("auto", "generate", "embed")
POOLINGS = ("auto", "cls", "mean", "max", "mean_sqrt_len", "last")
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8_e4m3", "fp8_e5m2")
ROPE_TYPES = ("none", "normal", "neox")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
BUCKETING = ("exponential", "linear")
# --quantization-encoding (MAX's names) -> the fw option it sets and the value; (None, TYPE): a GGUF file's
# weight type, which fw reads from the file itself. MAX's float4_e2m1fnx2 (NVFP4) has no fw kernel.
QUANTIZATION_ENCODINGS: dict[str, tuple[str | None, str]] = {
    "float32": ("dtype", "float32"), "bfloat16": ("dtype", "bfloat16"),
    "float8_e4m3fn": ("quantization", "fp8"), "gptq": ("quantization", "gptq"),
    "q4_0": (None, "Q4_0"), "q4_1": (None, "Q4_1"), "q8_0": (None, "Q8_0"), "q4_k": (None, "Q4_K"),
    "q6_k": (None, "Q6_K"),
}


@dataclass
class EngineConfig:
    """Everything that shapes an engine. Library keyword arguments use these names."""

    model: str | None = field(default=None, metadata=_opt(
        "Model: a local directory, a .gguf file, or a Hugging Face hub id (resolved through the HF cache).",
        aliases=(("--model-path", "SGLang"), ("--model-id", "TGI"))))
    revision: str | None = field(default=None, metadata=_opt("Hub revision (branch, tag or commit) of --model."))
    tokenizer: str | None = field(default=None, metadata=_opt("Tokenizer directory or hub id, if not the model's."))
    chat_template: str | None = field(default=None, metadata=_opt(
        "Chat template used instead of the model's own wherever a chat is rendered (the server's chat route, "
        "LLM.chat, fw generate --chat): a Jinja file, or the template itself (text holding {, } or a newline; "
        "backslash escapes such as \\n in it are read, as vLLM reads them). Read and parsed at start-up. "
        "vLLM's, SGLang's and MAX's name."))
    trust_remote_code: bool = field(default=False, metadata=_opt("Allow model repos to run their own Python code."))
    dtype: str = field(default="auto", metadata=_opt(
        "Weight and activation dtype. auto: the checkpoint's dtype (float16 becomes bfloat16 on CPU; GGUF: float32).",
        choices=("auto", "float32", "bfloat16", "float16")))
    device: str = field(default="auto", metadata=_opt(
        "cpu, cuda, cuda:N, or auto (cuda when available); gpu and gpu:N (MAX's names) mean cuda and cuda:N.",
        aliases=(("--devices", "MAX"),)))
    seed: int = field(default=0, metadata=_opt("Seeds torch's global generator at start-up; requests without a seed draw from it."))
    max_length: int | None = field(default=None, metadata=_opt(
        "Longest sequence (prompt + output) served; default: the model's context length.",
        aliases=(("--max-model-len", "vLLM"), ("--max-total-tokens", "TGI"))))
    attention_backend: str = field(default="auto", metadata=_opt(
        "Attention backend plugin by name, or auto (the highest-priority one that can run)."))
    moe_backend: str = field(default="auto", metadata=_opt(
        "MoE kernel plugin that computes Mixture-of-Experts layers' experts, or auto (the highest-priority one "
        "that can run)."))
    sampling_backend: str = field(default="default", metadata=_opt("Sampler plugin that makes the final token choice."))
    grammar_backend: str = field(default="auto", metadata=_opt(
        "Grammar backend plugin for structured output (response_format, guided_*), or auto: the highest-priority "
        "installed one that supports the request's kind of constraint. A request may name its own."))
    enable_structured_output: bool = field(default=True, metadata=_opt(
        "Constrained decoding (response_format json_object/json_schema, guided_*, structured_outputs, "
        "tool_choice required or named). On by default, as in vLLM and SGLang; off: such requests are refused "
        "(HTTP 400; LLM.generate raises) instead of being constrained. MAX's name; off by default in MAX."))
    tool_call_parser: str = field(default="auto", metadata=_opt(
        "Tool-call parser plugin that extracts tool calls from the text of chat requests with tool_choice auto "
        "(e.g. hermes, llama3_json), or auto: the one that recognises the model's chat template; with none "
        "that fits, tool_choice auto with tools is refused (required and named choices need no parser)."))
    speculative_config: dict | None = field(default=None, metadata=_opt(
        "Speculative decoding, a JSON object as vLLM's: {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
        "\"prompt_lookup_min\": 2, \"prompt_lookup_max\": 5}. method names a proposer plugin (ngram: prompt "
        "lookup; draft_model: a smaller model with the target's tokenizer, given as \"model\"); the output is the "
        "same as without it. Also disable_by_batch_size (default 8) and "
        "min_acceptance_rate (default 0.2); docs/speculative.md."))
    quantization: str | None = field(default=None, metadata=_opt(
        "Quantization method plugin; default: from the checkpoint's quantization_config.",
        aliases=(("--quantize", "TGI"),)))
    quantization_encoding: str | None = field(default=None, metadata=_opt(
        "MAX's weight encoding, as fw's options: float32 and bfloat16 set --dtype; float8_e4m3fn sets "
        "--quantization fp8, gptq --quantization gptq; q4_0, q4_k, q6_k (and q4_1, q8_0) name a GGUF file's "
        "weight type, checked against the file (which is its own quantization). float4_e2m1fnx2 is refused."))
    gguf_dequantize_at_load: bool | None = field(default=None, metadata=_opt(
        "GGUF models: dequantize every weight once at load instead of keeping linear weights packed (the gguf "
        "method). Default: keep packed on CPUs with AVX512-VNNI, where fw's packed-int kernels run Q4_0/Q4_1/"
        "Q8_0 faster than dense (other types are dequantized layer by layer, with a warning), dequantize on "
        "other CPUs, keep packed elsewhere; --quantization gguf keeps them packed."))
    rope_type: str = field(default="none", metadata=_opt(
        "GGUF models: llama.cpp rope layout of the q/k weights. none: the architecture's default; normal: "
        "interleaved pairs (fw un-permutes q/k rows); neox: already rotate-half (used as stored).",
        choices=ROPE_TYPES))
    kv_cache_page_size: int = field(default=16, metadata=_opt("Tokens per KV-cache page (block)."))
    kv_cache_dtype: str = field(default="auto", metadata=_opt(
        "dtype the KV cache is stored in: auto (the model's dtype), bfloat16, or fp8_e4m3 / fp8_e5m2 (1 byte per "
        "value, scaled by the checkpoint's per-layer k_scale/v_scale, else 1.0); the attention backend must "
        "support it (sdpa does).", choices=KV_CACHE_DTYPES))
    kv_cache_memory: str = field(default="1GiB", metadata=_opt(
        "KV-cache size on CPU, e.g. 512MiB, 2GiB, or a byte count."))
    device_memory_utilization: float = field(default=0.9, metadata=_opt(
        "On GPU: fraction of device memory fw may use for weights, activations and KV cache."))
    num_kv_blocks: int | None = field(default=None, metadata=_opt(
        "Exact number of KV-cache pages; overrides --kv-cache-memory (testing, tuning)."))
    enable_prefix_caching: bool = field(default=True, metadata=_opt(
        "Reuse KV pages of identical prompt prefixes across requests."))
    max_batch_size: int = field(default=64, metadata=_opt(
        "Most sequences in one engine step.",
        aliases=(("--max-num-seqs", "vLLM"), ("--max-running-requests", "SGLang"))))
    max_batch_input_tokens: int | None = field(default=None, metadata=_opt(
        f"Token budget of one engine step (decode tokens + prefill chunks); default: {GPU_STEP_TOKENS} on GPUs "
        f"and for embedding models, {CPU_STEP_TOKENS} for generation on CPUs, where a long prompt's step holds "
        "every running stream for its whole prefill.",
        aliases=(("--max-num-batched-tokens", "vLLM"), ("--max-batch-prefill-tokens", "TGI"))))
    prefill_chunk_size: int | None = field(default=None, metadata=_opt(
        "Longest prefill chunk of one sequence in one step; default: --max-batch-input-tokens."))
    model_impl: str = field(default="auto", metadata=_opt(
        "Which implementation runs the model: fw (a native architecture plugin), transformers (transformers' "
        "modelling code over fw's paged KV cache), or auto (native if a plugin claims the model, else "
        "transformers).", choices=MODEL_IMPLS))
    task: str = field(default="auto", metadata=_opt(
        "What the model serves: generate (text: /v1/completions, /v1/chat/completions), embed (vectors: "
        "/v1/embeddings, LLM.embed; a decoder's hidden states pooled per --pooling), or auto: the "
        "architecture's own task (embed for encoders such as BERT, generate for decoders). Requests for the "
        "other task are refused (400).", choices=TASKS))
    pooling: str = field(default="auto", metadata=_opt(
        "With --task embed: how token states become one vector: last (token), mean, cls (first token), max, "
        "mean_sqrt_len, or auto: the model's sentence-transformers 1_Pooling/config.json, else the "
        "architecture's default (cls for BERT, last for decoders).", choices=POOLINGS))
    normalize_embeddings: bool | None = field(default=None, metadata=_opt(
        "With --task embed: scale embeddings to unit length. Default: as the model's sentence-transformers "
        "modules.json says (a Normalize module), else yes."))
    enable_lora: bool = field(default=False, metadata=_opt(
        "Serve LoRA adapters (PEFT format) over the base model: requests name one (the model field of a server "
        "request, LLM.generate's lora_request) and a batch mixes the base model and several adapters; "
        "--lora-modules turns it on too. docs/lora.md."))
    lora_modules: list[str] = field(default_factory=list, metadata=_opt(
        "LoRA adapters loaded at start, NAME=PATH (a PEFT adapter directory; repeatable); the server lists "
        "each under its name in /v1/models.", repeatable=True))
    max_loras: int = field(default=8, metadata=_opt(
        "Most distinct LoRA adapters in one batch (vLLM's); a request whose adapter has no room waits for a step "
        "that has."))
    max_cpu_loras: int | None = field(default=None, metadata=_opt(
        "LoRA adapters held in memory at once (vLLM's; default --max-loras, at least that): loading one more evicts "
        "the least recently used adapter no request runs with, read again from its path when next named."))
    max_lora_rank: int = field(default=64, metadata=_opt("Largest LoRA rank an adapter may have."))
    custom_architectures: list[str] = field(default_factory=list, metadata=_opt(
        "Extra architectures: DIR:MODULE, FILE.py or a dotted module exposing ARCHITECTURES (repeatable).",
        repeatable=True))
    strict_plugins: bool = field(default=False, metadata=_opt("Fail if any plugin fails to load."))
    num_threads: int | None = field(default=None, metadata=_opt("CPU threads for torch; default: torch's."))
    # -- compiled execution (fw.compile, docs/compile.md) --
    enable_torch_compile: bool = field(default=False, metadata=_opt(
        "Run the model's forward step through torch.compile, one static-shape graph per shape bucket, "
        "compiled (or loaded from --compile-cache-dir) before the engine is ready."))
    compile_mode: str | None = field(default=None, metadata=_opt(
        "torch.compile mode; giving it implies --enable-torch-compile. Default: default (fastest to compile; on "
        "CPU the others only add compile time, fw's matmuls and attention being opaque kernels there).",
        choices=COMPILE_MODES))
    bucketing: str = field(default="exponential", metadata=_opt(
        "Shape buckets of --enable-torch-compile: exponential (doubling from min to max) or linear (doubling up "
        "to step, then every step); a step's token count and sampled rows are padded up to their bucket.",
        choices=BUCKETING))
    bucket_tokens_min: int | None = field(default=None, metadata=_opt("Smallest token-count bucket (default 1)."))
    bucket_tokens_step: int | None = field(default=None, metadata=_opt(
        "Token-count bucket step: linear spacing, and the rounding of larger exponential buckets (default 256)."))
    bucket_tokens_max: int | None = field(default=None, metadata=_opt(
        "Largest token-count bucket (default --max-batch-input-tokens); larger steps run uncompiled."))
    bucket_batch_min: int | None = field(default=None, metadata=_opt("Smallest batch-size bucket (default 1)."))
    bucket_batch_step: int | None = field(default=None, metadata=_opt(
        "Batch-size bucket step: linear spacing, and the rounding of larger exponential buckets (default 8)."))
    bucket_batch_max: int | None = field(default=None, metadata=_opt(
        "Largest batch-size bucket (default --max-batch-size)."))
    skip_warmup: bool = field(default=False, metadata=_opt(
        "With --enable-torch-compile: be ready without compiling every bucket first (each compiles at its "
        "first use while serving).", aliases=(("--skip-server-warmup", "SGLang"),)))
    compile_cache_dir: str | None = field(default=None, metadata=_opt(
        "Where compiled steps are cached, one folder per configuration; default: $FW_CACHE_DIR/compile "
        "(~/.cache/fw/compile)."))
    compile_cache_size_mb: int = field(default=2048, metadata=_opt(
        "Cap of --compile-cache-dir in MB: least recently used configurations are deleted beyond it (0: no cap)."))
    # -- several processes (fw.distributed, docs/distributed.md) --
    tensor_parallel_size: int = field(default=1, metadata=_opt(
        "Processes (ranks) one model is split across, by attention heads and MLP columns; rank 0 runs the "
        "engine, the others only the forward step. Gloo on CPU, NCCL on CUDA.",
        aliases=(("--tp", "SGLang"), ("--tp-size", "SGLang"), ("--num-shard", "TGI"))))
    distributed_executor_backend: str = field(default="auto", metadata=_opt(
        "How the other ranks start, by executor plugin name (`fw plugins list --kind executor`): `uni` one "
        "process, `mp` worker processes spawned here, `external_launcher` processes torchrun (env://) "
        "started; auto: external_launcher under a launcher, else uni at --tensor-parallel-size 1 and mp above "
        "(vLLM's flag)."))
    nnodes: int = field(default=1, metadata=_opt(
        "Machines the --tensor-parallel-size ranks are spread over, evenly; each runs fw with the same flags "
        "and its own --node-rank."))
    node_rank: int = field(default=0, metadata=_opt(
        "This machine's index among --nnodes: 0 runs the engine (and serves), others run workers only."))
    dist_init_addr: str | None = field(default=None, metadata=_opt(
        "HOST:PORT where rank 0 meets the other ranks (every node gives the same); default: a free loopback "
        "port, single node only."))
    dist_init_timeout: float = field(default=120.0, metadata=_opt(
        "Seconds for every rank to join at --dist-init-addr (and to load its shard) before start-up fails "
        "naming the ranks that did not; torch's own default is 30 minutes."))
    dist_timeout: float = field(default=60.0, metadata=_opt(
        "Seconds a collective waits for a peer while serving before the engine fails (a frozen worker); "
        "a worker that dies is noticed at once."))
    data_parallel_size: int = field(default=1, metadata=_opt(
        "Engine replicas behind one `fw serve` (each a --tensor-parallel-size group), each in its own process; "
        "a request goes to the one with the fewest tokens in flight, and a dead replica is routed around.",
        aliases=(("--dp", "SGLang"), ("--dp-size", "SGLang"), ("--data-parallel-degree", "MAX"))))

    def __post_init__(self) -> None:
        if self.compile_mode is not None and self.enable_torch_compile is False:
            self.enable_torch_compile = True  # --compile-mode alone turns compilation on
        if self.lora_modules and not self.enable_lora:
            self.enable_lora = True  # naming adapters to load turns LoRA on
        self.device = _device_name(self.device)
        self._apply_quantization_encoding()
        self.validate()

    def _apply_quantization_encoding(self) -> None:
        """--quantization-encoding (MAX) as --dtype or --quantization; a contradicting flag is refused."""
        if self.quantization_encoding is None:
            return
        encoding = self.quantization_encoding = str(self.quantization_encoding).strip().lower()
        if encoding not in QUANTIZATION_ENCODINGS:
            why = (" (NVFP4: fw has no float4 kernels)" if encoding == "float4_e2m1fnx2" else "")
            raise ConfigError(f"--quantization-encoding {encoding!r} cannot be served by fw{why}; accepted: "
                              f"{', '.join(QUANTIZATION_ENCODINGS)}")
        option, value = QUANTIZATION_ENCODINGS[encoding]
        if option is None:  # a GGUF weight type: checked against the file when the model is resolved
            return
        current, unset = getattr(self, option), ("auto" if option == "dtype" else None)
        if current not in (unset, value):
            raise ConfigError(f"--quantization-encoding {encoding} means {flag_name(option)} {value}, but "
                              f"{flag_name(option)} {current} is given: pass one of the two")
        setattr(self, option, value)

    def validate(self) -> None:
        if self.kv_cache_page_size <= 0:
            raise ConfigError(f"--kv-cache-page-size must be positive, got {self.kv_cache_page_size}")
        if self.max_batch_size <= 0:
            raise ConfigError(f"--max-batch-size must be positive, got {self.max_batch_size}")
        if self.max_batch_input_tokens is not None and self.max_batch_input_tokens <= 0:
            raise ConfigError(f"--max-batch-input-tokens must be positive, got {self.max_batch_input_tokens}")
        if self.prefill_chunk_size is not None and self.prefill_chunk_size <= 0:
            raise ConfigError(f"--prefill-chunk-size must be positive, got {self.prefill_chunk_size}")
        if not 0.0 < self.device_memory_utilization <= 1.0:
            raise ConfigError(
                f"--device-memory-utilization must be in (0, 1], got {self.device_memory_utilization}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"--num-kv-blocks must be at least 1, got {self.num_kv_blocks}")
        try:
            parse_size(self.kv_cache_memory)
        except ConfigError as exc:  # name the option: the size reader does not know which one it read
            raise ConfigError(f"--kv-cache-memory: {exc}") from None
        if self.model_impl not in MODEL_IMPLS:
            raise ConfigError(f"--model-impl must be one of {', '.join(MODEL_IMPLS)}; got {self.model_impl!r}")
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ConfigError(f"--max-loras and --max-lora-rank must be at least 1, got {self.max_loras} and "
                              f"{self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"--max-cpu-loras ({self.max_cpu_loras}) must be at least --max-loras "
                              f"({self.max_loras}): a batch's adapters are all held in memory")
        if self.enable_lora and self.enable_torch_compile:
            raise ConfigError("--enable-lora does not run with --enable-torch-compile yet; drop one of the two")
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ConfigError("--enable-lora does not run with --tensor-parallel-size > 1 yet (adapters would need "
                              "splitting like the layers they update)")
        if self.task not in TASKS:
            raise ConfigError(f"--task must be one of {', '.join(TASKS)}; got {self.task!r}")
        if self.pooling not in POOLINGS:
            raise ConfigError(f"--pooling must be one of {', '.join(POOLINGS)}; got {self.pooling!r}")
        if self.rope_type not in ROPE_TYPES:
            raise ConfigError(f"--rope-type must be one of {', '.join(ROPE_TYPES)}; got {self.rope_type!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {self.kv_cache_dtype!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"--dtype must be one of auto, float32, bfloat16, float16; got {self.dtype!r}")
        SpeculativeConfig.parse(self.speculative_config)  # its structure; the method is checked by the engine
        if self.chat_template is not None:
            from fw.chat_template import load_chat_template  # here: jinja2 only when a template is given

            load_chat_template(self.chat_template)  # a missing file or a template that does not parse
        self._validate_compile()
        self._validate_distributed()

    def _validate_compile(self) -> None:
        if self.compile_mode is not None and self.compile_mode not in COMPILE_MODES:
            raise ConfigError(f"--compile-mode must be one of {', '.join(COMPILE_MODES)}; got {self.compile_mode!r}")
        if self.bucketing not in BUCKETING:
            raise ConfigError(f"--bucketing must be one of {', '.join(BUCKETING)}; got {self.bucketing!r}")
        for dim in ("tokens", "batch"):
            values = {part: getattr(self, f"bucket_{dim}_{part}") for part in ("min", "step", "max")}
            for part, value in values.items():
                if value is not None and value < 1:
                    raise ConfigError(f"--bucket-{dim}-{part} must be at least 1, got {value}")
            if values["min"] is not None and values["max"] is not None and values["min"] > values["max"]:
                raise ConfigError(f"--bucket-{dim}-min ({values['min']}) is above --bucket-{dim}-max "
                                  f"({values['max']})")
        if self.compile_cache_size_mb < 0:
            raise ConfigError(f"--compile-cache-size-mb must be 0 (no cap) or more, got {self.compile_cache_size_mb}")

    def _validate_distributed(self) -> None:
        """Each option on its own; how they combine (ranks per node, the address) is checked where
        ranks start (fw.distributed.checks.check_layout)."""
        for name in ("tensor_parallel_size", "nnodes", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{flag_name(name)} must be at least 1, got {getattr(self, name)}")
        if self.node_rank < 0:
            raise ConfigError(f"--node-rank must be 0 or more, got {self.node_rank}")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"--dist-init-addr must be HOST:PORT, got {self.dist_init_addr!r}")
        for name in ("dist_init_timeout", "dist_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{flag_name(name)} must be positive, got {getattr(self, name)}")

    @property
    def step_tokens(self) -> int:
        """The step's token budget: --max-batch-input-tokens, else the default for the device and task."""
        return self.max_batch_input_tokens or default_step_tokens(self.device, self.task)

    @property
    def chunk_size(self) -> int:
        return self.prefill_chunk_size or self.step_tokens


def default_step_tokens(device: str, task: str = "auto") -> int:
    """--max-batch-input-tokens when none is given: CPU_STEP_TOKENS for generation on a CPU (`auto` without
    CUDA), else GPU_STEP_TOKENS. An encoder's step (task embed) has no decoding streams to hold up, and
    larger steps embed faster there (docs/performance.md)."""
    if task == "embed":
        return GPU_STEP_TOKENS
    if device == "auto":
        import torch  # only here: the config module itself loads without torch

        return GPU_STEP_TOKENS if torch.cuda.is_available() else CPU_STEP_TOKENS
    return CPU_STEP_TOKENS if device == "cpu" else GPU_STEP_TOKENS


def _device_name(name: str) -> str:
    """MAX's device names (`--devices gpu`, `gpu:N`) as torch's; several devices are refused here."""
    text = str(name).strip()
    if "," in text:
        raise ConfigError(f"--device {text}: one device only (cpu, cuda, cuda:N, gpu, gpu:N); "
                          "fw does not split a model across devices")
    if text == "gpu" or text.startswith("gpu:"):
        return "cuda" + text[3:]
    return text


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20,
          "g": 1e9, "gb": 1e9, "gib": 2**30, "t": 1e12, "tb": 1e12, "tib": 2**40}


def parse_size(text: str | int) -> int:
    """'2GiB' -> 2147483648. Accepts plain byte counts."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    unit = (m.group(2) or "").lower() if m else None
    if not m or unit not in _UNITS:
        raise ConfigError(f"cannot read size {text!r}: write e.g. 512MiB, 2GiB or a byte count")
    return int(float(m.group(1)) * _UNITS[unit])


# -- derivation of flags / env / YAML ---------------------------------------------------------


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_name(name: str) -> str:
    return "FW_" + name.upper()


def _base_type(tp: Any) -> Any:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (list,):
        return list
    if args:
        return _base_type(args[0]) if len(args) == 1 else args[0]
    return tp


def _fields(cls: type) -> list[tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(cls)
    return [(f, _base_type(hints[f.name])) for f in dataclasses.fields(cls)]


def _coerce(name: str, tp: Any, value: Any, source: str | None = None) -> Any:
    """`value` as type `tp`. `source` names where it came from (an FW_* variable, a
    --config key) so the error points at what the user has to change; default: the flag."""
    if value is None:
        return None
    try:
        if tp is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if tp is list:
            if isinstance(value, (list, tuple)):
                return [str(v) for v in value]
            return [p.strip() for p in str(value).split(",") if p.strip()]
        if tp is dict:  # a JSON object on the command line or in FW_*; a mapping from YAML or the library
            value = value if isinstance(value, dict) else json.loads(str(value))
            if not isinstance(value, dict):
                raise ValueError(value)
            return dict(value)
        return tp(value)
    except (TypeError, ValueError):
        raise ConfigError(
            f"{source or flag_name(name)}: cannot read {value!r} as "
            f"{'a JSON object' if tp is dict else getattr(tp, '__name__', tp)}") from None


def add_config_arguments(parser: argparse.ArgumentParser, cls: type = EngineConfig,
                         title: str = "engine options") -> None:
    """Add one flag per field. Defaults are left as None so that precedence can be resolved later."""
    group = parser.add_argument_group(f"{title} (also FW_<NAME> env vars and --config YAML keys)")
    for f, tp in _fields(cls):
        meta = dict(f.metadata)
        kwargs: dict[str, Any] = {"dest": f.name, "default": None, "help": meta.get("help", "")}
        if tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif meta.get("repeatable"):
            kwargs["action"] = "append"
        else:
            kwargs["type"] = str if tp in (Any, dict) else tp
            if "choices" in meta:
                kwargs["choices"] = meta["choices"]
        group.add_argument(flag_name(f.name), **kwargs)
        # another system's name: an action of its own (an error names the flag that was typed); a switch's
        # alias sets it (no --no- form of another system's name), a negated alias clears it
        for alias, system in meta.get("aliases", ()):
            if tp is bool:
                group.add_argument(alias, dest=f.name, action="store_const", const=True, default=None,
                                   help=f"{system}'s name for {flag_name(f.name)}.")
            else:
                extra = {k: v for k, v in kwargs.items() if k not in ("help", "dest")}
                group.add_argument(alias, dest=f.name, metavar=f.name.upper(), **extra,
                                   help=f"{system}'s name for {flag_name(f.name)}.")
        for alias, system in meta.get("negated_aliases", ()):
            group.add_argument(alias, dest=f.name, action="store_const", const=False, default=None,
                               help=f"{system}'s name for --no-{flag_name(f.name)[2:]}.")
    if not any(a.dest == "config" for a in parser._actions):
        parser.add_argument("--config", default=None, help="YAML file of options (keys: flag names); CLI wins.")


def load_yaml_options(path: str | os.PathLike) -> dict[str, Any]:
    import yaml  # here: yaml costs start-up time; only a --config file needs it

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config {path}: no such file")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config {path}: not valid YAML ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of option names to values")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def resolve_config(
    cli: dict[str, Any] | None = None,
    config_file: str | None = None,
    environ: dict[str, str] | None = None,
    cls: type = EngineConfig,
    shares_file_with: tuple[type, ...] = (),
    **overrides: Any,
):
    """Build `cls` from defaults, YAML, environment and CLI values (CLI wins).

    `cli` holds parsed argparse values (None meaning "not given"); `overrides`
    are library keyword arguments, treated like CLI values. `shares_file_with`
    names the other config classes whose keys may appear in the same YAML file
    (`fw serve` reads engine and server options from one file)."""
    environ = os.environ if environ is None else environ
    fields = {f.name: tp for f, tp in _fields(cls)}
    others = {f.name for other in shares_file_with for f in dataclasses.fields(other)}
    values: dict[str, Any] = {}
    config_file = config_file or env.CONFIG.get(environ)
    if config_file:
        for key, value in load_yaml_options(config_file).items():
            if key in others and key not in fields:
                continue
            if key not in fields:
                known = ", ".join(sorted(set(fields) | others))
                raise ConfigError(f"--config {config_file}: unknown option {key!r}; known: {known}")
            values[key] = _coerce(key, fields[key], value, f"--config {config_file}: {key}")
    for name, tp in fields.items():
        if env_name(name) in environ:
            values[name] = _coerce(name, tp, environ[env_name(name)], env_name(name))
    for source in (cli or {}, overrides):
        for name, value in source.items():
            if name not in fields:
                if source is overrides:
                    raise ConfigError(f"unknown engine option {name!r}; known: {', '.join(sorted(fields))}")
                continue
            if value is not None:
                values[name] = _coerce(name, fields[name], value)
    return cls(**values)
