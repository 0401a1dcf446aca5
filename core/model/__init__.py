"""The model: its hyper-parameters read once (`config`: ModelConfig), finding it (`source`: a directory, hub id or
GGUF file), reading its files (`hf`, `gguf_file`, `gguf_header`, `fast_tokenizer`, `quantized_weights`) and
building and loading it as the engine plan says (`loader`). The layers architectures build it from are fw.layers."""

from fw.model.source import ModelSource, resolve_model

__all__ = ["ModelSource", "resolve_model"]
