"""What a sentence-transformers checkpoint says about turning token states into one embedding.

sentence-transformers stores a model as a pipeline in `modules.json`: the transformer, then a
`Pooling` module (its `config.json` says which pooling), then optionally `Normalize` (no config of
its own: its presence means unit-length embeddings). `sentence_bert_config.json` holds the longest
input the model was trained on (`max_seq_length`). fw runs the pipelines made of these three
modules; any other module (`Dense`, `LayerNorm`, ...) is refused by name rather than skipped,
since skipping it would return different embeddings without a word."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from fw.errors import ModelLoadError

# 1_Pooling/config.json flags -> fw's pooling names
_POOLING_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_lasttoken": "last",
    "pooling_mode_weightedmean_tokens": "weightedmean",
}
# newer sentence-transformers write one `pooling_mode` string instead of the flags
_POOLING_NAMES = {"cls": "cls", "mean": "mean", "max": "max", "mean_sqrt_len_tokens": "mean_sqrt_len",
                  "lasttoken": "last", "weightedmean": "weightedmean"}
_KNOWN_MODULES = ("Transformer", "Pooling", "Normalize")


@dataclass(frozen=True)
class SentenceTransformersConfig:
    pooling: str | None  # None: the pipeline has no Pooling module
    normalize: bool
    max_seq_length: int | None
    where: str  # the files read, for messages and the log


def read_sentence_transformers(model_dir: Path) -> SentenceTransformersConfig | None:
    """The pipeline in `model_dir/modules.json`, or None when the directory has none."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return None
    modules = _load_json(modules_file)
    if not isinstance(modules, list):
        raise ModelLoadError(f"{modules_file}: expected a list of modules")
    pooling, normalize, read = None, False, ["modules.json"]
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind not in _KNOWN_MODULES:
            raise ModelLoadError(
                f"{modules_file}: the sentence-transformers module {module.get('type')!r} "
                f"({module.get('path')!r}) is not supported by fw (it runs {', '.join(_KNOWN_MODULES)}); "
                f"its embeddings would differ from sentence-transformers' without it")
        if kind == "Pooling":
            path = Path(module.get("path") or "") / "config.json"
            pooling = _pooling_method(_load_json(model_dir / path), model_dir / path)
            read.append(str(path))
        elif kind == "Normalize":
            normalize = True
    max_seq_length = None
    bert_config = model_dir / "sentence_bert_config.json"
    if bert_config.is_file():
        max_seq_length = _load_json(bert_config).get("max_seq_length")
        read.append(bert_config.name)
    return SentenceTransformersConfig(pooling, normalize, max_seq_length, ", ".join(read))


def _pooling_method(config: dict, path: Path) -> str:
    if isinstance(config.get("pooling_mode"), str):
        names = [_POOLING_NAMES.get(config["pooling_mode"], config["pooling_mode"])]
    else:
        names = [name for flag, name in _POOLING_FLAGS.items() if config.get(flag)]
    if len(names) != 1:
        raise ModelLoadError(f"{path}: fw runs exactly one pooling mode, the file selects "
                             f"{', '.join(names) or 'none'}")
    if names[0] == "weightedmean":
        raise ModelLoadError(f"{path}: weighted-mean pooling is not supported by fw (cls, mean, max, "
                             f"mean_sqrt_len and last are)")
    return names[0]


def _load_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from None
