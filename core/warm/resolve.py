"""What the server would pick for a warm-cache context's flags, worked out the way
the loader does it (same functions), once per context: the device, the model's
config, the dtype, the attention backend, the tokenizer grammar backends see.

Why here: artifacts must warm what `fw serve` with the same flags will use
(the cpu_paged kernel only if cpu_paged is chosen, grammars for the model's
own vocabulary), and must agree with each other. Each helper returns None
while the model's files are not present yet (`--check` before a download)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from fw.warm.artifact import WarmContext


def _memo(context: WarmContext, key: str, make: Callable[[], Any]) -> Any:
    if key not in context.memo:
        context.memo[key] = make()
    return context.memo[key]


def device(context: WarmContext) -> torch.device:
    """`--target-device` when given (not checked against this machine: that is its point), else the
    device `--device` resolves to here."""
    def make() -> torch.device:
        from fw.model_loader.loader import resolve_device

        target = context.options.get("target_device")
        return torch.device(target) if target else resolve_device(context.config.device)

    return _memo(context, "device", make)


def model_config(context: WarmContext) -> Any:
    """The model's transformers config (also stored as `context.hf_config`), or None without files."""
    if context.source is None:
        return None
    if context.hf_config is None:
        from fw.model_loader.loader import model_config as load

        context.hf_config, context.memo["architecture"] = load(context.config, context.plugins, context.source)
    return context.hf_config


def dtype(context: WarmContext) -> torch.dtype | None:
    def make() -> torch.dtype | None:
        from fw.model_loader.loader import resolve_dtype

        hf_config = model_config(context)
        return None if hf_config is None else resolve_dtype(context.config.dtype, hf_config, context.source,
                                                            device(context))

    return _memo(context, "dtype", make) if context.source is not None else None


def attention_backend(context: WarmContext) -> str | None:
    """The attention backend the server would choose, or None without the model's files (with
    --attention-backend NAME, NAME: the server either runs it or refuses to start, and skipping the
    model's config here saves importing transformers' config classes, about 4 s)."""
    if context.config.attention_backend != "auto":
        return context.config.attention_backend
    if context.source is None:
        return None

    def make() -> str:
        from fw.model_loader.loader import attention_requirements
        from fw.plugins.selection import select_attention_backend

        cfg = context.config
        req = attention_requirements(cfg, model_config(context), dtype(context), device(context))
        name = None if cfg.attention_backend == "auto" else cfg.attention_backend
        return select_attention_backend(context.plugins.registry("attention_backend"), req, name).chosen.name

    return _memo(context, "attention_backend", make)


def tokenizer(context: WarmContext) -> Any:
    """The model's transformers tokenizer as the engine loads it (--tokenizer, a GGUF file's
    converted one, or the model directory's), or None without the model's files."""
    if context.source is None:
        return None

    def make() -> Any:
        from fw.model_loader.gguf_file import GGUFModel
        from fw.model_loader.hf import load_tokenizer

        cfg, source = context.config, context.source
        if cfg.tokenizer:
            return load_tokenizer(cfg.tokenizer, cfg.trust_remote_code)
        if source.kind == "gguf":
            return GGUFModel(source.path).tokenizer()
        return load_tokenizer(source.path, cfg.trust_remote_code)

    return _memo(context, "tokenizer", make)


def grammar_tokenizer(context: WarmContext) -> Any:
    """The `fw.grammar.GrammarTokenizer` the engine would hand grammar backends, or None."""
    if context.source is None:
        return None

    def make() -> Any:
        from fw.grammar.tokenizer import GrammarTokenizer
        from fw.model_loader.loader import eos_ids

        hf_config, tok = model_config(context), tokenizer(context)
        return GrammarTokenizer(tok, hf_config.vocab_size, eos_ids(hf_config, tok, context.source))

    return _memo(context, "grammar_tokenizer", make)
