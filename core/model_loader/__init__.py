"""Finding a model (directory, hub id, GGUF file) and reading its config, tokenizer and weights."""

from fw.model_loader.source import ModelSource, resolve_model

__all__ = ["ModelSource", "resolve_model"]
