"""GGUF files: config from metadata, tokenizer via transformers (converted once,
then cached), and weights either dequantized with the `gguf` library or handed
on still packed (`GGUFWeight`) to a quantization method that keeps them so.

Tensor names follow llama.cpp's conventions and are mapped to Hugging Face
names here; architecture plugins may transform tensors further (Llama undoes
llama.cpp's Q/K row permutation) through `ArchitectureSpec.gguf_weight_transform`.
"""

from __future__ import annotations

import re
import warnings
from collections import Counter
from functools import cached_property
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from fw.config import ROPE_TYPES
from fw.errors import ModelLoadError
from fw.layers.gguf_weight import GGUFWeight
from fw.layers.weights import unpermute_gguf_qk
from fw.model.gguf_header import GGUFHeader
from fw.model.config_snapshot import cached_config
from fw.model.derived_cache import entry_dir, entry_key

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_tensor_name(gguf_name: str) -> str:
    m = _BLOCK.match(gguf_name)
    if m:
        layer, part, kind = m.groups()
        if part not in _LAYER_NAMES:
            raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no known Hugging Face name")
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    stem, _, kind = gguf_name.rpartition(".")
    if stem not in _GLOBAL_NAMES:
        raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no known Hugging Face name")
    return f"{_GLOBAL_NAMES[stem]}.{kind}"


class GGUFModel:
    """One .gguf file, read lazily."""

    def __init__(self, path: Path):
        self.path = path

    @cached_property
    def reader(self) -> GGUFHeader:
        """The metadata and tensor table (fw's own reader: gguf.GGUFReader takes seconds on a vocabulary)."""
        try:
            return GGUFHeader(self.path)
        except Exception as exc:
            raise ModelLoadError(f"{self.path} is not a readable GGUF file: {exc}") from None

    def field(self, key: str, default=None):
        return self.reader.get(key, default)

    @property
    def architecture(self) -> str:
        arch = self.field("general.architecture")
        if not arch:
            raise ModelLoadError(f"{self.path}: GGUF metadata has no general.architecture")
        return arch

    def hf_config(self, hf_architecture: str):
        """The transformers config the metadata makes, recorded once per file and read back without
        transformers on later starts (fw.model.config_snapshot)."""
        key = entry_key("gguf-configs", [self.path], hf_architecture)
        path = self.path  # the view keeps its builder: it reopens the file, not this reader's map of it
        return cached_config("gguf-configs", key, lambda: GGUFModel(path)._transformers_config(hf_architecture))

    def _transformers_config(self, hf_architecture: str):
        """A transformers config built from the metadata (only the keys it needs)."""
        from transformers import AutoConfig  # here: transformers costs start-up time
        from transformers.integrations.ggml import GGUF_CONFIG_MAPPING  # here: transformers costs start-up time

        arch = self.architecture
        mapping = GGUF_CONFIG_MAPPING.get(arch)
        if mapping is None:
            raise ModelLoadError(f"{self.path}: GGUF architecture {arch!r} has no config mapping in transformers")
        kwargs = {}
        for key, hf_key in mapping.items():
            value = self.field(f"{arch}.{key}")
            if value is not None and hf_key is not None:
                kwargs[hf_key] = value
        if "vocab_size" not in kwargs:
            kwargs["vocab_size"] = len(self.reader.fields["tokenizer.ggml.tokens"])
        for key, hf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                            ("padding_token_id", "pad_token_id")):
            value = self.field(f"tokenizer.ggml.{key}")
            if value is not None:
                kwargs[hf_key] = int(value)
        kwargs["tie_word_embeddings"] = all(t.name != "output.weight" for t in self.reader.tensors)
        kwargs["architectures"] = [hf_architecture]
        model_type = {"mistral": "mistral"}.get(arch, arch)
        try:
            return AutoConfig.for_model(model_type, **kwargs)
        except Exception as exc:
            raise ModelLoadError(f"{self.path}: could not build a config for GGUF architecture {arch!r}: {exc}") from None

    def tokenizer_cache_dir(self) -> Path:
        """Where `tokenizer()` keeps the converted tokenizer (`fw warm-cache` checks and fills it)."""
        return _tokenizer_cache_dir(self.path)

    def tokenizer(self):
        """transformers' GGUF tokenizer conversion takes seconds: done once per file and kept in fw's cache
        with its snapshot, which later starts load with `tokenizers` alone (fw.model.fast_tokenizer)."""
        from fw.model.hf import cached_tokenizer  # here: fw.model.hf imports transformers' config classes

        cached = self.tokenizer_cache_dir()

        def convert():
            from transformers import AutoTokenizer  # here: transformers costs start-up time

            try:
                return AutoTokenizer.from_pretrained(str(self.path.parent), gguf_file=self.path.name)
            except Exception as exc:
                raise ModelLoadError(f"{self.path}: its tokenizer could not be read: {exc}") from None

        def from_transformers():
            from transformers import AutoTokenizer  # here: transformers costs start-up time

            return AutoTokenizer.from_pretrained(str(cached))

        return cached_tokenizer(cached, from_transformers, convert)

    def linear_weight_type(self) -> str | None:
        """The ggml type most of the file's linear weights are stored in ("Q4_K" for a Q4_K_M file, whose
        few Q6_K layers are outnumbered), or None if it has none; what --quantization-encoding is checked against."""
        types = Counter(t.tensor_type.name for t in self.reader.tensors
                        if len(t.shape) == 2 and is_packable_linear(hf_tensor_name(t.name)))
        return types.most_common(1)[0][0] if types else None

    def tensor_type(self, gguf_name: str) -> int | None:
        """The ggml type id of a tensor (say "token_embd.weight"), or None if the file has no such tensor."""
        return next((int(t.tensor_type) for t in self.reader.tensors if t.name == gguf_name), None)

    def iter_weights(self, dtype: torch.dtype, keep_packed: Callable[[str], bool] | None = None,
                     head_from_embedding: bool = False) -> Iterator[tuple[str, "torch.Tensor | GGUFWeight"]]:
        """(HF name, tensor) pairs, dequantized to `dtype`; names for which `keep_packed(name)` is true
        come as `GGUFWeight` (block bytes, one row per output row) instead, whatever their type.
        `head_from_embedding`: the tied embedding comes packed as `lm_head.weight` only (the head keeps its
        blocks and the embedding's rows are read from them, fw.layers.packed_embedding), never dequantized."""
        for t in self.reader.tensors:
            shape = tuple(int(x) for x in reversed(t.shape.tolist()))  # GGUF lists dims fastest-first
            name = hf_tensor_name(t.name)
            packed = (keep_packed is not None and len(shape) == 2 and keep_packed(name)) or (
                head_from_embedding and t.name == "token_embd.weight")
            if packed:
                weight = GGUFWeight(_stored_bytes(t.data, shape[0]), int(t.tensor_type), t.tensor_type.name, shape)
                yield ("lm_head.weight" if t.name == "token_embd.weight" else name), weight
                continue
            try:
                tensor = _dequantized(t.data, t.tensor_type, shape, dtype)
            except Exception as exc:
                raise ModelLoadError(f"{self.path}: tensor {t.name} ({t.tensor_type.name}) "
                                     f"could not be dequantized: {exc}") from None
            yield name, tensor


_PIECE_BYTES = 16 << 20  # fp32 bytes dequantized at a time


def _dequantized(data: np.ndarray, qtype, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The tensor in `dtype`, dequantized a piece of rows at a time into its own storage: a large tensor's whole
    fp32 form (SmolLM2's embedding: 113 MB) is never held beside it."""
    # here: the gguf library costs start-up time; only dequantizing needs it
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    out = torch.empty(shape, dtype=dtype)
    rows_out = out.view(-1, shape[-1])
    rows_in = data.reshape(rows_out.shape[0], -1)
    step = max(1, _PIECE_BYTES // (4 * shape[-1]))
    for start in range(0, rows_out.shape[0], step):
        piece = rows_in[start:start + step]
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            values = np.array(piece)  # a copy: the memory map is read-only
        else:
            values = dequantize(piece, qtype)
        rows_out[start:start + step] = torch.from_numpy(values.reshape(-1, shape[-1]))
    return out


def _stored_bytes(array: np.ndarray, rows: int) -> torch.Tensor:
    """A tensor's bytes as stored (uint8 [rows, bytes per row], whatever its type), a view of the file's
    read-only memory map: the load copies each layer's bytes once, when its method packs them, so the file is
    never held in anonymous memory as a whole. Nothing writes to it (the map would fault)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        return torch.from_numpy(array.view(np.uint8).reshape(rows, -1))


def is_packable_linear(name: str) -> bool:
    """Checkpoint names a kept-quantized load hands on packed: 2-D weights except the embedding (its
    rows are looked up, and a tied LM head reuses it dense)."""
    return name.endswith(".weight") and "embed_tokens" not in name


def weight_transform(rope_type: str, arch_transform: Callable | None) -> Callable | None:
    """--rope-type: `none` keeps the architecture plugin's GGUF transform (Llama: un-permute q/k),
    `normal` un-permutes q/k rows whatever the architecture says, `neox` leaves them as stored.
    `normal` and `neox` replace the architecture's transform (see docs/choices.md)."""
    if rope_type == "none":
        return arch_transform
    if rope_type == "normal":
        return unpermute_gguf_qk
    if rope_type == "neox":
        return None
    raise ModelLoadError(f"--rope-type must be one of {', '.join(ROPE_TYPES)}; got {rope_type!r}")


def transform_weight(transform: Callable, name: str, tensor, cfg):
    """Apply a GGUF weight transform; to a packed weight only if it is a row permutation (rows of a
    GGUF block format move whole), which the transform itself reveals on a column of row indices."""
    if not isinstance(tensor, GGUFWeight):
        return transform(name, tensor, cfg)
    rows = tensor.shape[0]
    probe = torch.arange(rows, dtype=torch.float64).unsqueeze(1)
    moved = transform(name, probe, cfg)
    if moved is probe:
        return tensor
    index = moved.reshape(-1).round().long() if moved.shape == probe.shape else None
    if index is None or not torch.equal(index.sort().values, torch.arange(rows)):
        raise ModelLoadError(f"{name}: the architecture's GGUF weight transform is not a row permutation, so the "
                             f"weight cannot stay quantized; load the model with --gguf-dequantize-at-load")
    if torch.equal(index, torch.arange(rows)):
        return tensor
    return tensor.permute_rows(index)


def _tokenizer_cache_dir(path: Path) -> Path:
    return entry_dir("gguf-tokenizers", entry_key("gguf-tokenizers", [path]))
