"""What the server would pick for a warm-cache context's flags: the engine plan (fw.plan) for the
context, resolved once per model source, and what artifacts read from it: the device, the model's
config, the dtype, the attention backend, the tokenizer grammar backends see.

Why here: artifacts must warm what `fw serve` with the same flags will use (the cpu_paged kernel
only if cpu_paged is chosen, grammars for the model's own vocabulary), and must agree with each
other and with the engine, so they read the same plan the engine does. Each helper returns None
while the model's files are not present yet (`--check` before a download)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from fw.grammar.tokenizer import GrammarTokenizer
from fw.model.loader import eos_ids
from fw.plan import resolve
from fw.plan.rules import open_tokenizer
from fw.warm.artifact import WarmContext


def _memo(context: WarmContext, key: Any, make: Callable[[], Any]) -> Any:
    if key not in context.memo:
        context.memo[key] = make()
    return context.memo[key]


def plan(context: WarmContext) -> Any:
    """The engine plan (fw.plan.EnginePlan) for the context's flags and model files (none yet: the
    model's decisions are skipped), on `--target-device` when given (not checked against this
    machine: that is its point). Never downloads, never loads the tokenizer (see `tokenizer`)."""
    def make() -> Any:
        target = context.options.get("target_device")
        return resolve(context.config, context.plugins, source=context.source, tokenizer=False,
                       device=torch.device(target) if target else None, download=False)

    return _memo(context, ("plan", context.source), make)


def device(context: WarmContext) -> torch.device:
    """The plan's device: `--target-device`, else what `--device` resolves to here."""
    def make() -> torch.device:
        resolved = plan(context)
        resolved.check("device")
        return resolved.device

    return _memo(context, "device", make)


def model_config(context: WarmContext) -> Any:
    """The model's transformers config (also stored as `context.hf_config`), or None without files."""
    if context.source is None:
        return None
    if context.hf_config is None:
        resolved = plan(context)
        resolved.check("model", "architecture")
        context.hf_config, context.memo["architecture"] = resolved.hf_config, resolved.architecture
    return context.hf_config


def dtype(context: WarmContext) -> torch.dtype | None:
    if model_config(context) is None:
        return None
    return _memo(context, "dtype", lambda: plan(context).dtype)


def attention_backend(context: WarmContext) -> str | None:
    """The attention backend the server would choose, or None without the model's files (with
    --attention-backend NAME, NAME: the server either runs it or refuses to start, and skipping the
    model's config here saves importing transformers' config classes, about 4 s)."""
    if context.config.attention_backend != "auto":
        return context.config.attention_backend
    if model_config(context) is None:
        return None

    def make() -> str:
        resolved = plan(context)
        resolved.check("attention_backend")
        return resolved.attention.chosen.name

    return _memo(context, "attention_backend", make)


def tokenizer(context: WarmContext) -> Any:
    """The model's transformers tokenizer as the engine loads it (fw.plan.rules.open_tokenizer: --tokenizer,
    a GGUF file's converted one, or the model directory's), or None without the model's files."""
    if context.source is None:
        return None

    def make() -> Any:
        return open_tokenizer(context.config, context.source)

    return _memo(context, "tokenizer", make)


def grammar_tokenizer(context: WarmContext) -> Any:
    """The `fw.grammar.GrammarTokenizer` the engine would hand grammar backends, or None."""
    if context.source is None:
        return None

    def make() -> Any:
        hf_config, tok = model_config(context), tokenizer(context)
        return GrammarTokenizer(tok, hf_config.vocab_size, eos_ids(hf_config, tok, context.source))

    return _memo(context, "grammar_tokenizer", make)
