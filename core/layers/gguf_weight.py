"""A linear weight still in GGUF block format, as the GGUF reader hands it to a
quantization method that keeps it packed (the built-in `gguf` method).

Why a type of its own: the loader moves weights as (name, tensor) pairs; a
packed weight needs its ggml type and logical shape beside the bytes. Rows are
independent in every GGUF block format (blocks run along the input dim), so
row permutations and fused-shard concatenation work on the packed bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GGUFWeight:
    data: torch.Tensor  # uint8 [rows, bytes_per_row]
    ggml_type: int  # gguf.GGMLQuantizationType value
    type_name: str  # e.g. "Q4_K", for messages
    shape: tuple[int, int]  # logical (rows, cols) = (out_features, in_features)

    def permute_rows(self, index: torch.Tensor) -> "GGUFWeight":
        return GGUFWeight(self.data[index], self.ggml_type, self.type_name, self.shape)
