"""`PoolingParams`: what one embedding request asks beyond its input."""

from __future__ import annotations

from dataclasses import dataclass

from fw.errors import InvalidRequestError


@dataclass(frozen=True)
class PoolingParams:
    """Per-request embedding settings, named as in vLLM and the OpenAI API.

    `dimensions` keeps the first N values of the embedding, which only a Matryoshka-trained model's
    embeddings survive (the engine refuses it for other models); the shortened vector is normalised
    again when the model's embeddings are normalised."""

    dimensions: int | None = None

    def __post_init__(self) -> None:
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise InvalidRequestError(f"dimensions must be a positive integer, got {d!r}", param="dimensions")
