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

from fw.errors import UnsupportedConfigurationError


@dataclass(frozen=True)
class GGUFWeight:
    data: torch.Tensor  # uint8 [rows, bytes_per_row]
    ggml_type: int  # gguf.GGMLQuantizationType value
    type_name: str  # e.g. "Q4_K", for messages
    shape: tuple[int, int]  # logical (rows, cols) = (out_features, in_features)

    def permute_rows(self, index: torch.Tensor) -> "GGUFWeight":
        return GGUFWeight(self.data[index], self.ggml_type, self.type_name, self.shape)

    def narrow_rows(self, start: int, length: int) -> "GGUFWeight":
        """Output rows [start, start+length): a column-parallel rank's slice (rows are independent)."""
        return GGUFWeight(self.data.narrow(0, start, length), self.ggml_type, self.type_name, (length, self.shape[1]))

    def narrow_cols(self, start: int, length: int, what: str) -> "GGUFWeight":
        """Input columns [start, start+length): a row-parallel rank's slice, cut between blocks. Blocks run
        along the input dimension, so a cut inside one is impossible: `what` (the flag and layer) is named
        in the error that says so."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # here: the gguf library loads only for GGUF models

        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(self.ggml_type)]
        if start % block or length % block:
            raise UnsupportedConfigurationError(
                f"{what}: each rank's {length} input features are not a whole number of {self.type_name} blocks "
                f"({block} weights each), and fw cuts packed GGUF weights only between blocks; choose a "
                f"tensor-parallel size that leaves each rank whole blocks, or add --gguf-dequantize-at-load")
        data = self.data.narrow(1, start // block * size, length // block * size)
        return GGUFWeight(data, self.ggml_type, self.type_name, (self.shape[0], length))
