"""How a served model turns hidden states into embeddings: decided once, when the engine starts.

The pooling method comes from --pooling, else the checkpoint's sentence-transformers files, else the
architecture's `default_pooling` (CLS for BERT, the last token for decoders). Normalisation comes from
--normalize-embeddings, else the files (a `Normalize` module), else on: what vLLM does for embedding
models, and what OpenAI's embeddings are. A model supports `dimensions` only when its config.json
declares Matryoshka training (`is_matryoshka` / `matryoshka_dimensions`, vLLM's keys)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fw.errors import InvalidRequestError
from fw.pooling.sentence_transformers import SentenceTransformersConfig, read_sentence_transformers

logger = logging.getLogger("fw.pooling")

POOLING_METHODS = ("cls", "mean", "max", "mean_sqrt_len", "last")
# the methods that read every prompt position (a decoder's prefix cache would skip some of them)
READS_EVERY_POSITION = frozenset({"cls", "mean", "max", "mean_sqrt_len"})


@dataclass(frozen=True)
class PoolingConfig:
    method: str
    normalize: bool
    hidden_size: int
    matryoshka_dimensions: tuple[int, ...] | None = None  # None: not Matryoshka; (): any size up to hidden
    max_seq_length: int | None = None  # sentence-transformers' max_seq_length, when the files give one
    source: str = ""  # where method and normalisation came from, for the log

    @property
    def matryoshka(self) -> bool:
        return self.matryoshka_dimensions is not None

    def check_dimensions(self, dimensions: int | None, model: str = "this model") -> None:
        """A request's `dimensions`, refused (400) unless the model declares Matryoshka support."""
        if dimensions is None or dimensions == self.hidden_size:
            return
        if not self.matryoshka:
            raise InvalidRequestError(
                f"{model} does not support `dimensions`: its embeddings are not Matryoshka-trained (its "
                f"config.json declares neither is_matryoshka nor matryoshka_dimensions), so a shortened "
                f"vector would not be a usable embedding; omit dimensions to get all {self.hidden_size}",
                param="dimensions")
        allowed = self.matryoshka_dimensions
        if dimensions > self.hidden_size or (allowed and dimensions not in allowed):
            choices = ", ".join(map(str, allowed)) if allowed else f"1 to {self.hidden_size}"
            raise InvalidRequestError(f"dimensions {dimensions} is not one {model} was trained for "
                                      f"(matryoshka_dimensions: {choices})", param="dimensions")


def resolve_pooling(pooling: str, normalize: bool | None, hf_config: Any, model_dir: Path | None,
                    default_pooling: str) -> PoolingConfig:
    """The model's pooling from the flags (`pooling` is --pooling, "auto" to read the model), its files
    and the architecture's default."""
    st: SentenceTransformersConfig | None = read_sentence_transformers(model_dir) if model_dir else None
    if pooling != "auto":
        method, method_from = pooling, "--pooling"
    elif st is not None and st.pooling is not None:
        method, method_from = st.pooling, f"sentence-transformers ({st.where})"
    else:
        method, method_from = default_pooling, "the architecture's default"
    if normalize is not None:
        norm, norm_from = normalize, "--normalize-embeddings"
    elif st is not None:
        norm, norm_from = st.normalize, "sentence-transformers (modules.json)"
    else:
        norm, norm_from = True, "the default"
    config = PoolingConfig(method, norm, hf_config.hidden_size, _matryoshka(hf_config),
                           st.max_seq_length if st else None,
                           f"pooling {method} from {method_from}, normalize {norm} from {norm_from}")
    logger.info("embeddings: %s", config.source)
    return config


def _matryoshka(hf_config: Any) -> tuple[int, ...] | None:
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    if dims:
        return tuple(sorted(int(d) for d in dims))
    return () if getattr(hf_config, "is_matryoshka", False) else None


def engine_pooling(config: Any, loaded: Any) -> PoolingConfig | None:
    """The pooling of an engine's loaded model (`fw.model.LoadedModel`) under --task embed; None
    when the engine generates."""
    if config.task != "embed":
        return None
    source = loaded.source
    return resolve_pooling(config.pooling, config.normalize_embeddings, loaded.hf_config,
                           source.path if source.kind == "directory" else None,
                           loaded.architecture.default_pooling)
