"""Tiny random-weight BERT checkpoints (transformers' BertConfig) with a WordPiece tokenizer, for the
embedding tests: made locally, no network. Optionally with sentence-transformers' files
(modules.json, 1_Pooling/config.json, sentence_bert_config.json), so the same directory loads in
sentence-transformers as the oracle."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tiny_models import _WORDS

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def build_bert_tokenizer(path: Path):
    from transformers import BertTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    vocab = SPECIALS + sorted(set(_WORDS)) + list("abcdefghijklmnopqrstuvwxyz0123456789.,!?;:'-")
    vocab += [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = BertTokenizerFast(vocab_file=str(path / "vocab.txt"), do_lower_case=True)
    tokenizer.save_pretrained(str(path))
    return tokenizer


def build_bert(path: Path, *, seed: int = 0, pooling: str | None = "mean", normalize: bool = True,
               max_seq_length: int | None = 64, **config) -> Path:
    """A random BertModel in `path`; `pooling` (sentence-transformers' name: cls, mean, max, lasttoken) writes
    the sentence-transformers files, None leaves them out. `config` overrides BertConfig fields."""
    from transformers import BertConfig, BertModel

    tokenizer = build_bert_tokenizer(path)
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=128, **config)
    model = BertModel(cfg, add_pooling_layer=True).eval()
    with torch.no_grad():  # BERT's init leaves LayerNorms at 1/0: make them count
        for name, p in model.named_parameters():
            if "LayerNorm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(path))
    if pooling is not None:
        write_sentence_transformers(path, pooling, normalize, cfg.hidden_size, max_seq_length)
    return path


def write_sentence_transformers(path: Path, pooling: str, normalize: bool, hidden: int,
                                max_seq_length: int | None) -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules, indent=2))
    (path / "1_Pooling").mkdir(exist_ok=True)
    flags = {f"pooling_mode_{flag}": flag == _ST_FLAGS[pooling] for flag in _ST_FLAGS.values()}
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": hidden, **flags}))
    if max_seq_length is not None:
        (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length,
                                                                    "do_lower_case": False}))


# sentence-transformers' pooling names -> the flag in 1_Pooling/config.json
_ST_FLAGS = {"cls": "cls_token", "mean": "mean_tokens", "max": "max_tokens",
             "mean_sqrt_len": "mean_sqrt_len_tokens", "lasttoken": "lasttoken"}
