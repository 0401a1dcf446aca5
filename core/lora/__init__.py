"""LoRA adapters over a served base model (docs/lora.md): PEFT adapters loaded into fw's linear layers,
a batch mixing the base model and several adapters, named per request."""

from fw.lora.request import LoRARequest

__all__ = ["LoRARequest"]
