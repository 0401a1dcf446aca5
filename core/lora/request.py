"""`LoRARequest`: which adapter a request runs with."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, as vLLM's `LoRARequest(lora_name, lora_int_id, lora_path)`; `path` loads it
    the first time it is named (later requests may give the name alone)."""

    name: str
    path: str | None = None
