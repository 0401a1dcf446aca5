"""Embeddings: pooling token states into one vector per input (docs/embeddings.md).

`PoolingParams` is what a request asks; `PoolingConfig` how the served model pools (from --pooling,
the sentence-transformers files, the architecture's default); `EncoderEngine` runs encoder-only
models; decoders embed through `LLMEngine` with --task embed."""

from fw.pooling.config import PoolingConfig, resolve_pooling
from fw.pooling.params import PoolingParams

__all__ = ["PoolingConfig", "PoolingParams", "resolve_pooling"]
