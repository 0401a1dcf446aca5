"""A LoRA adapter in PEFT's format, read from disk: `adapter_config.json` and `adapter_model.safetensors`.

Each targeted linear layer W gets a low-rank update: y = x W^T + scale * (x A^T) B^T, with A [r, in],
B [out, r] and scale = lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA). What fw does not run is
refused by name (bias training, modules_to_save, DoRA, fan_in_fan_out, per-module ranks or alphas),
never skipped: the adapter would otherwise change the model differently than PEFT does."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from fw.errors import ModelLoadError

PEFT_PREFIX = "base_model.model."


@dataclass
class LoRAAdapter:
    name: str
    path: Path
    rank: int
    scale: float
    # the model's linear-layer name (HF naming, e.g. "model.layers.0.self_attn.q_proj") -> (A [r, in], B [out, r])
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    base_model: str | None = None  # base_model_name_or_path, as the adapter says


def load_adapter(name: str, path: str | Path) -> LoRAAdapter:
    path = Path(path).expanduser()
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"LoRA adapter {name!r}: {path} has no adapter_config.json (a PEFT adapter directory "
                             f"holds adapter_config.json and adapter_model.safetensors)")
    config = json.loads(config_file.read_text())
    _check_config(name, config)
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return LoRAAdapter(name, path, rank, scale, _read_weights(name, path), config.get("base_model_name_or_path"))


def _check_config(name: str, config: dict) -> None:
    why = []
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        why.append(f"peft_type {config.get('peft_type')!r} (only LORA)")
    if config.get("bias", "none") != "none":
        why.append(f"bias {config['bias']!r} (only 'none')")
    if config.get("modules_to_save"):
        why.append(f"modules_to_save {config['modules_to_save']!r}")
    if config.get("use_dora"):
        why.append("use_dora (DoRA)")
    if config.get("fan_in_fan_out"):
        why.append("fan_in_fan_out")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        why.append("rank_pattern / alpha_pattern (per-module ranks)")
    if why:
        raise ModelLoadError(f"LoRA adapter {name!r}: fw does not run {'; '.join(why)}")


def _read_weights(name: str, path: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    from safetensors.torch import load_file  # here: only loading an adapter needs it

    file = path / "adapter_model.safetensors"
    if not file.is_file():
        raise ModelLoadError(f"LoRA adapter {name!r}: {path} has no adapter_model.safetensors (.bin adapters: "
                             f"convert them with PEFT's save_pretrained(safe_serialization=True))")
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(file)).items():
        module, _, kind = key.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        which = kind.removesuffix(".weight").removesuffix(".default")
        if which not in ("A", "B"):
            raise ModelLoadError(f"LoRA adapter {name!r}: tensor {key!r} is not a lora_A / lora_B weight")
        parts.setdefault(module, {})[which] = tensor
    weights = {}
    for module, ab in parts.items():
        if set(ab) != {"A", "B"}:
            raise ModelLoadError(f"LoRA adapter {name!r}: {module} has lora_{''.join(ab)} without its pair")
        weights[module] = (ab["A"], ab["B"])
    if not weights:
        raise ModelLoadError(f"LoRA adapter {name!r}: {file} holds no LoRA weights")
    return weights
