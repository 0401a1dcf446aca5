"""`resolve(config, plugins) -> EnginePlan`: every decision the engine makes before it reads a
weight, once, in the engine's order, with each candidate's verdict and reasons.

Why one function: the loader, `fw doctor`, `fw warm-cache` and the compile-cache key used to make
these decisions with their own code; now they all read the plan, and a changed rule (a backend's
priority, a capability check) changes all of them. The ranking itself is fw.plugins.selection's.
Problems are collected, not raised, so doctor can report all of them; `EnginePlan.check()` raises
the first, as the engine does."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import torch

from fw.config import EngineConfig, flag_name
from fw.devices import cuda_capability, describe
from fw.errors import ConfigError, FwError, ModelLoadError
from fw.model.gguf_file import GGUFModel
from fw.kernels.hardware import this_cpu_flags
from fw.model.hf import load_hf_config
from fw.kv_cache.dtype import resolve_kv_cache_dtype
from fw.model.source import ModelSource, cached_snapshot, local_source, resolve_model
from fw.plan import rules
from fw.plan.record import SELECTIONS, Candidate, Decision, EnginePlan, Problem, Resolved
from fw.plugins.manager import PluginManager
from fw.plugins.registry import Registry
from fw.plugins.selection import (MoeKernelChooser, Selection, prefers_verified, select_attention_backend,
                                  select_moe_kernel, selection_rank)
from fw.plugins.specs import MoeRequirements, verification

NEEDS_MODEL = "needs the model's config and the device (see the problems)"


def resolve(config: EngineConfig, plugins: PluginManager, *, source: ModelSource | None = None,
            device: torch.device | None = None, tokenizer: bool = True, explain: bool = True,
            download: bool = True, until: str | None = None) -> EnginePlan:
    """The plan for `config` with `plugins`.

    `source`: the model's files when already resolved; `device`: a device to plan for instead of
    --device (warm-cache's --target-device); `tokenizer`: load the tokenizer (the engine does; a
    check that needs no tokenizer saves its ~1 s); `explain`: judge every candidate, not only the
    chosen ones (doctor; judging a quantization method imports its library); `download`: fetch a hub
    model missing from the local cache (doctor and checks never download); `until="architecture"`:
    stop after the architecture (the engine factory's look, before the engine resolves the whole plan;
    the later decisions are then marked skipped)."""
    if until not in (None, "architecture"):
        raise ValueError(f"resolve(until={until!r}): only None (everything) or 'architecture'")
    return _Resolver(config, plugins, explain).run(source, device, tokenizer, download, until)


class _Resolver:
    def __init__(self, config: EngineConfig, plugins: PluginManager, explain: bool):
        self.config, self.plugins, self.explain = config, plugins, explain
        self.decisions: dict[str, Decision] = {}
        self.resolved: list[Resolved] = []
        self.problems: list[Problem] = []
        self.values: dict[str, Any] = {}

    # -- bookkeeping ----------------------------------------------------------------------------

    def fail(self, decision: str, error: FwError) -> str:
        self.problems.append(Problem(decision, str(error), error))
        return str(error)

    def resolve_option(self, option: str, value: Any, by: str, because: str) -> None:
        self.resolved = [r for r in self.resolved if r.option != option]
        self.resolved.append(Resolved(option, value, by, because))

    def decide(self, decision: Decision) -> None:
        self.decisions[decision.name] = decision

    def run(self, source, device, tokenizer: bool, download: bool, until: str | None) -> EnginePlan:
        v = self.values
        found = self._source(source, download)
        device_ok = self._device(device)  # the device even without a model (warm-cache before a download)
        # the architecture even without a device
        if found and self._architecture() and device_ok and until != "architecture":
            if tokenizer:
                self._tokenizer()
            self._dtype_and_length()
            self._attention()
            self._quantization()
            self._moe()
        for name in SELECTIONS:
            if name not in self.decisions:
                self.decide(Decision(name, _OPTIONS[name], getattr(self.config, _OPTIONS[name]),
                                     skipped=NEEDS_MODEL if until is None else f"not resolved (until={until})"))
        return EnginePlan(
            source=v.get("source"), device=v.get("device"), architecture=v.get("architecture"), dtype=v.get("dtype"),
            max_length=v.get("max_length"), kv_cache_dtype=v.get("kv_cache_dtype"), attention=v.get("attention"),
            quantization=v.get("quantization"), quant_config=v.get("quant_config"),
            gguf_dequantize_at_load=v.get("gguf_dequantize_at_load"), moe_kernels=v.get("moe_kernels"),
            decisions=tuple(self.decisions.values()), resolved=tuple(self.resolved), problems=tuple(self.problems),
            hf_config=v.get("hf_config"), gguf=v.get("gguf"), tokenizer=v.get("tokenizer"))

    # -- the decisions, in the engine's order ---------------------------------------------------

    def _source(self, source: ModelSource | None, download: bool) -> bool:
        name = self.config.model
        if source is None:
            try:
                if download:
                    source = resolve_model(name, self.config.revision)
                else:
                    source = local_source(name)
                    if source is None:
                        path = cached_snapshot(name, self.config.revision)
                        if path is None:
                            raise ModelLoadError(
                                f"{name}: not in the local Hugging Face cache, and fw doctor and checks do not download. "
                                f"Run `fw warm-cache --model {name}` to download and verify it.")
                        source = ModelSource("directory", path, name, self.config.revision)
            except FwError as exc:
                self.decide(Decision("model", "model", name, problem=self.fail("model", exc)))
                return False
        self.values["source"] = source
        self.decide(Decision("model", "model", name, chosen=str(source.path), details={"kind": source.kind}))
        return True

    def _device(self, device: torch.device | None) -> bool:
        requested = self.config.device
        try:
            device = device if device is not None else rules.resolve_device(requested)
        except FwError as exc:
            self.decide(Decision("device", "device", requested, problem=self.fail("device", exc)))
            return False
        self.values["device"] = device
        self.decide(Decision("device", "device", requested, chosen=device))
        if requested == "auto":
            self.resolve_option("device", str(device), "fw",
                                "auto: a CUDA device is available" if device.type == "cuda" else
                                "auto: no CUDA device is available here, so the CPU")
        return True

    def _architecture(self) -> bool:
        cfg, source = self.config, self.values["source"]
        details: dict[str, Any] = {}
        try:
            if source.kind == "gguf":
                gguf = self.values["gguf"] = GGUFModel(source.path)
                gguf_arch, hf_names, hf_config = gguf.architecture, [], None
            else:
                hf_config = load_hf_config(source.path, cfg.trust_remote_code, cfg.revision)
                gguf_arch, hf_names = None, list(getattr(hf_config, "architectures", None) or [])
        except FwError as exc:
            self.decide(Decision("architecture", "model_impl", cfg.model_impl,
                                 problem=self.fail("architecture", exc)))
            return False
        details["model_architectures"] = [gguf_arch] if gguf_arch else hf_names
        problem = arch = None
        try:
            arch = rules.find_architecture(self.plugins, hf_names, gguf_arch, cfg.model_impl, hf_config)
            if hf_config is None:
                hf_config = self.values["gguf"].hf_config(arch.hf_architectures[0])
        except FwError as exc:
            problem = self.fail("architecture", exc)
        candidates = self._architecture_rows(gguf_arch, hf_names, hf_config, arch)
        self.decide(Decision("architecture", "model_impl", cfg.model_impl, arch.name if arch and not problem else None,
                             candidates, details, problem=problem))
        if problem:
            return False
        self.values.update(architecture=arch, hf_config=hf_config)
        return True

    def _architecture_rows(self, gguf_arch, hf_names, hf_config, chosen) -> tuple[Candidate, ...]:
        registry = self.plugins.registry("architecture")
        if not self.explain:  # the chosen one only
            return (_candidate(registry, chosen.name, "chosen"),) if chosen is not None else ()
        impl = self.config.model_impl
        wanted = (f"GGUF architecture {gguf_arch!r}" if gguf_arch is not None else
                  ", ".join(hf_names) or "(config.json lists no architectures)")
        rows = []
        for spec in rules.architectures_in_order(self.plugins):
            reasons: list[str] = []
            if spec.fallback:
                if gguf_arch is not None:
                    reasons.append("a fallback runs Hugging Face checkpoint directories, not GGUF files")
                else:
                    why = spec.rejection_reason(hf_config) if spec.rejection_reason is not None else None
                    if why:
                        reasons.append(why)
                if not reasons and impl == "fw":
                    reasons.append("--model-impl fw uses native architectures only")
            else:
                claims = (gguf_arch in spec.gguf_architectures) if gguf_arch is not None else \
                    any(n in spec.hf_architectures for n in hf_names)
                if not claims:
                    handles = ", ".join((*spec.hf_architectures, *spec.gguf_architectures)) or "nothing by name"
                    reasons.append(f"does not claim {wanted} (claims {handles})")
                elif impl == "transformers":
                    reasons.append("--model-impl transformers uses the fallback only")
            if reasons:
                rows.append(_candidate(registry, spec.name, "rejected", reasons))
            elif chosen is not None and spec.name == chosen.name:
                rows.append(_candidate(registry, spec.name, "chosen", note="fallback: runs the model with "
                                       "transformers' modelling code" if spec.fallback else None))
            else:
                note = ("a native architecture claims the model first (--model-impl transformers would use this)"
                        if spec.fallback else f"{chosen.name} comes first" if chosen is not None else None)
                rows.append(_candidate(registry, spec.name, "accepted", note=note))
        return tuple(rows)

    def _tokenizer(self) -> None:
        cfg, source = self.config, self.values["source"]
        origin = rules.tokenizer_origin(cfg, source)
        try:
            tok = rules.open_tokenizer(cfg, source, self.values.get("gguf"))
        except FwError as exc:
            self.decide(Decision("tokenizer", "tokenizer", cfg.tokenizer, problem=self.fail("tokenizer", exc),
                                 details={"from": origin}))
            return
        self.values["tokenizer"] = tok
        template = "--chat-template" if cfg.chat_template is not None else "the tokenizer's own"
        self.decide(Decision("tokenizer", "tokenizer", cfg.tokenizer, chosen=type(tok).__name__,
                             details={"from": origin, "chat_template": template}))

    def _dtype_and_length(self) -> None:
        cfg, source, device, hf_config = (self.config, self.values["source"], self.values["device"],
                                          self.values["hf_config"])
        dtype = self.values["dtype"] = rules.resolve_dtype(cfg.dtype, hf_config, source, device)
        name = str(dtype).removeprefix("torch.")
        self.decide(Decision("dtype", "dtype", cfg.dtype, dtype))
        if cfg.dtype == "auto":
            if device.type == "cpu":
                isa = [f for f in ("avx512_bf16", "amx_bf16", "bf16") if f in this_cpu_flags()]
                because = (f"auto on CPU: this CPU has native bf16 ({', '.join(isa) or 'bf16'}), about 1.8x "
                           f"float32's decode speed" if dtype == torch.bfloat16 else
                           "auto on CPU: no native bf16 instructions here (emulated bf16 is slower than float32)")
            elif source.kind == "gguf":
                because = "auto on GPU for a GGUF file (its dequantized weights have no dtype of their own)"
            else:
                because = "auto on GPU: the checkpoint's dtype"
            self.resolve_option("dtype", name, "fw", because)
        model_max, named = rules.model_max_length(hf_config)
        problem = None
        if cfg.max_length is None:
            self.resolve_option("max_length", model_max, "model", "the model's context length "
                                "(max_position_embeddings)" if named else "the config names no context length: 2048")
        elif cfg.max_length > model_max:
            problem = self.fail("max_length", ConfigError(
                f"--max-length {cfg.max_length} exceeds the model's context length {model_max}"))
        self.values["max_length"] = cfg.max_length or model_max
        self.decide(Decision("max_length", "max_length", cfg.max_length, self.values["max_length"], problem=problem))
        kv = self.values["kv_cache_dtype"] = resolve_kv_cache_dtype(cfg.kv_cache_dtype, dtype)
        self.decide(Decision("kv_cache_dtype", "kv_cache_dtype", cfg.kv_cache_dtype, kv))
        if cfg.kv_cache_dtype == "auto":
            self.resolve_option("kv_cache_dtype", name, "fw", "auto: the KV cache is stored in the model's dtype")

    def _attention(self) -> None:
        cfg, arch = self.config, self.values["architecture"]
        if arch.task == "embed":  # an encoder attends within each sequence itself: no backend, no KV cache
            self.values["attention"] = Selection(rules.ENCODER_ATTENTION)
            self.decide(Decision("attention_backend", "attention_backend", cfg.attention_backend,
                                 skipped="an encoder-only model: it attends within each input with "
                                 "fw.layers.BidirectionalAttention, with no KV cache and no attention backend plugin"))
            return
        req = rules.attention_requirements(cfg, self.values["hf_config"], self.values["dtype"], self.values["device"])
        decision, selection = self._by_priority("attention_backend", "attention_backend", req,
                                                select_attention_backend)
        self.values["attention"] = selection
        self.decide(decision)
        if decision.requested == "auto" and selection is not None:
            self.resolve_option("attention_backend", selection.chosen.name, f"plugin {selection.chosen.name}",
                                f"auto: the highest-priority backend that can run (priority "
                                f"{selection.chosen.priority_on(req.device)} on {req.device}){_verified_clause(req)}")

    def _by_priority(self, kind: str, option: str, req: Any, select: Callable) -> tuple[Decision, Selection | None]:
        """Attention backends and MoE kernels: every candidate with its reasons (fw.plugins.selection ranks
        them), the named one or auto's choice, and for a named one that cannot run, what auto would choose."""
        registry: Registry = self.plugins.registry(kind)
        flag = flag_name(option)
        requested = getattr(self.config, option)
        explicit = requested not in (None, "auto")
        details: dict[str, Any] = {"auto_choice": None}
        try:
            auto_selection = select(registry, req, None)
            details["auto_choice"] = auto_selection.chosen.name
        except FwError as exc:
            auto_selection, auto_error = None, exc
        instead = (f"auto would choose {auto_selection.chosen.name}" if auto_selection is not None else
                   "auto finds none that can run either")
        selection = problem = None
        if not explicit:
            if auto_selection is None:
                problem = self.fail(kind, auto_error)
            else:
                selection = auto_selection
        else:
            try:
                selection = select(registry, req, requested)
            except FwError as exc:
                problem = self.fail(kind, type(exc)(f"{exc} Without {flag}, {instead}."))
                if auto_selection is not None:
                    details["instead"] = auto_selection.chosen.name
        chosen = selection.chosen.name if selection is not None else None
        rank = functools.partial(selection_rank, device=req.device)
        rows = [] if not explicit or requested in registry else [_missing(requested)]
        for reg in sorted(registry.registrations(), key=lambda r: (-rank(r.spec), r.spec.name)):
            reasons = reg.spec.rejection_reasons(req)
            extra = {"priority": rank(reg.spec), "verified": _verified_on(reg.spec, req)}
            if reasons:
                status, note = "rejected", None
            elif reg.spec.name == chosen:
                status, note = "chosen", None
            else:
                status = "accepted"
                note = (f"not named by {flag}" if explicit else
                        selection.passed_over.get(reg.spec.name) if selection is not None else None)
            rows.append(Candidate(reg.spec.name, status, tuple(reasons), note, reg.plugin, reg.distribution, extra))
        details["requirements"] = _requirements(req)
        decision = Decision(kind, option, requested, chosen, tuple(rows), details,
                            warning=selection.warning if selection is not None else None, problem=problem)
        return decision, selection

    def _quantization(self) -> None:
        cfg, device, arch, hf_config = (self.config, self.values["device"], self.values["architecture"],
                                        self.values["hf_config"])
        registry = self.plugins.registry("quantization_method")
        gguf = self.values["source"].kind == "gguf"
        details: dict[str, Any] = {}
        if gguf:
            dequantize = self.values["gguf_dequantize_at_load"] = rules.gguf_dequantizes_at_load(cfg, device)
            if cfg.gguf_dequantize_at_load is None:
                self.resolve_option(
                    "gguf_dequantize_at_load", dequantize, "fw",
                    "--quantization gguf keeps the weights packed" if cfg.quantization == "gguf" else
                    ("default on CPU: fw's packed-int kernels run the packed weights faster than dense ones"
                     if not dequantize else
                     "default on CPU without AVX512-VNNI: dense weights decode about 6x faster than the "
                     "packed reference path")
                    if device.type == "cpu" else "default off the CPU: device memory is scarcer")
            details["gguf_weights"] = "dequantized at load" if dequantize else "kept packed"
        problem = warning = None
        name = qcfg = None
        try:
            rules.check_quantization_encoding(cfg, self.values["source"], self.values.get("gguf"))
            qcfg = rules.quantization_config(cfg, hf_config, device, gguf)
            name, qcfg, warning = rules.choose_quantization(cfg, hf_config, arch, self.plugins, device, gguf)
        except FwError as exc:
            problem = self.fail("quantization_method", exc)
        details["checkpoint_format"] = (qcfg or {}).get("quant_method") if qcfg else None
        self.values.update(quantization=name, quant_config=qcfg)
        if self.explain:
            candidates = self._quantization_rows(registry, qcfg, name)
        else:
            candidates = (_candidate(registry, name, "chosen"),) if name is not None else ()
        self.decide(Decision("quantization_method", "quantization", cfg.quantization, name, candidates, details,
                             warning=warning, problem=problem))
        if cfg.quantization is None:
            self.resolve_option("quantization", name, f"plugin {name}" if name else "model",
                                f"detected from the checkpoint's {'GGUF file' if gguf else 'quantization_config'}"
                                if name else "the checkpoint is not quantized (or dequantized at load)")

    def _quantization_rows(self, registry: Registry, qcfg: dict | None, chosen: str | None
                           ) -> tuple[Candidate, ...]:
        """Every method's verdict: the named or detected one (chosen, or rejected with why it cannot run),
        the others by whether they read the checkpoint's format and can run here."""
        cfg, device, arch = self.config, self.values["device"], self.values["architecture"]
        named = cfg.quantization
        detected = [s.name for s in registry if qcfg and s.detects is not None and s.detects(qcfg)]
        target = named or (detected[0] if detected else None)
        rows = [] if named is None or named in registry else [_missing(named)]
        for reg in registry.registrations():
            spec = reg.spec
            runs = rules.quantization_reasons(spec, device)
            try:
                rules.check_method_supported(arch, spec.name)
            except FwError as exc:
                runs.append(str(exc))
            reads = bool(qcfg) and spec.detects is not None and spec.detects(qcfg)
            if spec.name == target:
                how = "--quantization" if named else "detected from the checkpoint"
                record = verification(spec, device.type, cuda_capability(device))
                rows.append(Candidate(spec.name, "rejected" if runs else "chosen", tuple(runs), how, reg.plugin,
                                      reg.distribution, {"verified": str(record) if record else None}))
            elif qcfg:
                why = [] if reads else [f"does not read this checkpoint's format ({qcfg.get('quant_method', '?')})"]
                note = "another method was chosen first" if not why else None
                rows.append(Candidate(spec.name, "rejected" if why or runs else "accepted", tuple(why + runs), note,
                                      reg.plugin, reg.distribution))
            else:
                rows.append(Candidate(spec.name, "rejected" if runs else "accepted", tuple(runs),
                                      None if runs else "used only when named by --quantization",
                                      reg.plugin, reg.distribution))
        return tuple(rows)

    def _moe(self) -> None:
        cfg, arch, c = self.config, self.values["architecture"], self.values["hf_config"]
        registry = self.plugins.registry("moe_kernel")
        name = cfg.moe_backend
        try:  # the build asks it per MoE layer; an unknown name fails for every model
            self.values["moe_kernels"] = MoeKernelChooser(registry, name)
        except FwError as exc:
            self.decide(Decision("moe_kernel", "moe_backend", name, candidates=(_missing(name),),
                                 problem=self.fail("moe_kernel", exc)))
            return
        experts = rules.num_experts(c)
        if arch.fallback and experts:
            self.decide(Decision("moe_kernel", "moe_backend", name,
                                 skipped="the transformers fallback computes experts with transformers' own code"))
            return
        if not experts:
            self.decide(Decision("moe_kernel", "moe_backend", name,
                                 skipped="not a Mixture-of-Experts model: no MoE kernel is needed"))
            return
        device, dtype = self.values["device"], self.values["dtype"]
        req = MoeRequirements(
            device=device.type, dtype=str(dtype).removeprefix("torch."), num_experts=experts,
            top_k=int(getattr(c, "num_experts_per_tok", None) or 1), hidden_size=c.hidden_size,
            intermediate_size=getattr(c, "moe_intermediate_size", None) or c.intermediate_size,
            activation=getattr(c, "hidden_act", None) or "silu", capability=cuda_capability(device))
        decision, selection = self._by_priority("moe_kernel", "moe_backend", req, select_moe_kernel)
        self.decide(decision)
        if name == "auto" and selection is not None:
            self.resolve_option("moe_backend", selection.chosen.name, f"plugin {selection.chosen.name}",
                                f"auto: the highest-priority MoE kernel that can run{_verified_clause(req)}")


_OPTIONS = {"architecture": "model_impl", "attention_backend": "attention_backend",
            "quantization_method": "quantization", "moe_kernel": "moe_backend"}


def _candidate(registry: Registry, name: str, status: str, reasons=(), note: str | None = None) -> Candidate:
    reg = registry.registration(name) if name in registry else None
    return Candidate(name, status, tuple(reasons), note, reg.plugin if reg else None,
                     reg.distribution if reg else None)


def _missing(name: str) -> Candidate:
    return Candidate(name, "rejected", ("not installed",))


def _verified_on(spec: Any, req: Any) -> str | None:
    """Where `spec` was verified for `req`'s device kind ("cuda sm_90 (NVIDIA H200, 2026-11-25, ...)"), or None."""
    record = verification(spec, req.device, getattr(req, "capability", None))
    return str(record) if record is not None else None


def _requirements(req: Any) -> dict:
    """The requirements as shown (a GPU's compute capability only on a GPU)."""
    shown = dataclasses.asdict(req)
    if shown.get("capability") is None:
        shown.pop("capability", None)
    return shown


def _verified_clause(req: Any) -> str:
    """How auto's ranking reads on `req`'s device: verified candidates first off the CPU."""
    if not prefers_verified(req.device):
        return ""
    return (f", among those verified on {describe(req.device, getattr(req, 'capability', None))} first "
            f"(unverified ones only when none is)")
