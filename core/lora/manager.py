"""The adapters an engine serves: loaded from PEFT directories into every targeted linear layer of the
model, each under a slot number, and the per-step map from the step's rows to their adapter slots.

As vLLM: `--max-loras` bounds the distinct adapters of one batch (the scheduler holds back a request
whose adapter would exceed it), `--max-cpu-loras` the adapters whose weights are held in memory at
once (default: --max-loras). Adapters are registered by name and path (`--lora-modules`, the load
route, a request's path); one not used for longest and run by no request is evicted to make room and
read again from its path when next named. fw keeps held adapters on the model's device (no separate
device pool yet). `--max-lora-rank` bounds their rank."""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from typing import Callable

import torch
from torch import nn

from fw.errors import ConfigError, FwError, InvalidRequestError, ModelLoadError
from fw.layers.blocks import FUSED_PROJECTIONS
from fw.layers.linear import Linear
from fw.lora.adapter import LoRAAdapter, load_adapter
from fw.lora.layers import LoRALinearMethod, LoRAStep

logger = logging.getLogger("fw.lora")


class LoRANotFoundError(FwError):
    """A request names an adapter that is not loaded (and gives no path to load it from)."""

    status_code = 404
    error_type = "not_found_error"


class LoRACapacityError(FwError):
    """Every adapter slot (--max-cpu-loras) holds an adapter that requests run with: a new one must wait."""

    status_code = 429
    error_type = "rate_limit_error"


class LoRAManager:
    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device,
                 max_cpu_loras: int | None = None, in_use: Callable[[], set[str]] = set):
        self.max_loras, self.max_rank = max_loras, max_rank
        self.max_cpu_loras = max_cpu_loras or max_loras
        self.in_use = in_use  # the adapter names requests in the engine run with: never evicted
        self.dtype, self.device = dtype, device
        self.step = LoRAStep()
        self.layers: dict[str, Linear] = {}
        self.methods: dict[str, LoRALinearMethod] = {}
        self._fused_silu = {}  # prefix -> the layer's silu_gate_up as loaded
        for layer in model.modules():
            if isinstance(layer, Linear) and layer.prefix != "lm_head":
                self.methods[layer.prefix] = LoRALinearMethod(layer.method, self.step)
                self.layers[layer.prefix] = layer
                self._fused_silu[layer.prefix] = layer.silu_gate_up
        self._wrapped = False  # whether the layers run the LoRA methods now (see `_wrap`)
        self.registered: dict[str, str] = {}  # adapter name -> its path: what may be named (/v1/models lists it)
        self.slots: OrderedDict[str, int] = OrderedDict()  # held adapters -> slot, least recently used first
        self.adapters: dict[str, LoRAAdapter] = {}  # held adapters
        self.num_evictions = 0
        self._loads = itertools.count()
        self._salts: dict[str, bytes] = {}

    # -- adapters ------------------------------------------------------------------------

    def add(self, name: str, path: str) -> int:
        """Register the adapter at `path` as `name` and load it (so a bad adapter fails here); its slot. A name
        already registered is an error."""
        if name in self.registered:
            raise InvalidRequestError(f"LoRA adapter {name!r} is already loaded; unload it first", param="lora_name")
        slot = self._load(name, path)
        self.registered[name] = path
        # prefix-cache pages are keyed by the registration, not the name: a name loaded again may hold other weights
        self._salts[name] = f"lora:{next(self._loads)}:{name}".encode()
        return slot

    def acquire(self, name: str) -> bytes:
        """Make a registered adapter ready for a request: read back from its path if it was evicted, marked
        most recently used; the prefix-cache salt of its requests (`Request.cache_salt`)."""
        if name not in self.registered:
            raise LoRANotFoundError(f"no LoRA adapter named {name!r} is loaded (loaded: "
                                    f"{', '.join(self.registered) or 'none'})")
        if name in self.slots:
            self.slots.move_to_end(name)
        else:
            self._load(name, self.registered[name])
        return self._salts[name]

    def remove(self, name: str) -> None:
        if name not in self.registered:
            raise LoRANotFoundError(f"no LoRA adapter named {name!r} is loaded (loaded: "
                                    f"{', '.join(self.registered) or 'none'})")
        if name in self.slots:
            self._drop(name)
        del self.registered[name], self._salts[name]

    def slot(self, name: str) -> int:
        if name not in self.slots:
            raise LoRANotFoundError(f"no LoRA adapter named {name!r} is held in memory (held: "
                                    f"{', '.join(self.slots) or 'none'})")
        return self.slots[name]

    def _load(self, name: str, path: str) -> int:
        adapter = load_adapter(name, path)
        if adapter.rank > self.max_rank:
            raise ModelLoadError(f"LoRA adapter {name!r} has rank {adapter.rank}, above --max-lora-rank "
                                 f"{self.max_rank}; start the engine with --max-lora-rank {adapter.rank}")
        per_layer = self._layer_updates(adapter)
        self._make_room(name)
        slot = next(i for i in range(self.max_cpu_loras + 1) if i not in self.slots.values())
        for prefix, update in per_layer.items():
            self.methods[prefix].adapters[slot] = update
        self.slots[name], self.adapters[name] = slot, adapter
        logger.info("LoRA adapter %s loaded from %s (rank %d, %d layers)", name, path, adapter.rank, len(per_layer))
        return slot

    def _make_room(self, name: str) -> None:
        """Evict the least recently used adapter no request runs with while --max-cpu-loras are held."""
        if len(self.slots) < self.max_cpu_loras:
            return
        busy = self.in_use()
        victim = next((held for held in self.slots if held not in busy), None)
        if victim is None:
            raise LoRACapacityError(
                f"LoRA adapter {name!r} cannot be loaded: the {len(self.slots)} adapters held (--max-cpu-loras "
                f"{self.max_cpu_loras}: {', '.join(self.slots)}) all have requests running; retry when one "
                f"finishes, or start the server with a larger --max-cpu-loras")
        self._drop(victim)
        self.num_evictions += 1
        logger.info("LoRA adapter %s evicted (--max-cpu-loras %d); it is read again when next named", victim,
                    self.max_cpu_loras)

    def _drop(self, name: str) -> None:
        slot = self.slots.pop(name)
        for method in self.methods.values():
            method.adapters.pop(slot, None)
        del self.adapters[name]

    def _layer_updates(self, adapter: LoRAAdapter) -> dict[str, tuple]:
        """Per fw layer: the stacked A and the block-diagonal, scaled B of the adapter's modules on it."""
        shards: dict[str, list[tuple[int | None, torch.Tensor, torch.Tensor]]] = {}
        for module, (a, b) in adapter.weights.items():
            prefix, shard = self._target(adapter.name, module)
            shards.setdefault(prefix, []).append((shard, a, b))
        out = {}
        for prefix, parts in shards.items():
            layer = self.layers[prefix]
            sizes = layer.output_sizes
            starts = [sum(sizes[:i]) for i in range(len(sizes))]
            r = adapter.rank
            a_cat = torch.empty(len(parts) * r, layer.input_size)
            b_bd = torch.zeros(layer.output_size, len(parts) * r)
            for j, (shard, a, b) in enumerate(sorted(parts, key=lambda p: p[0] or 0)):
                start, size = (0, layer.output_size) if shard is None else (starts[shard], sizes[shard])
                if a.shape != (r, layer.input_size) or b.shape != (size, r):
                    raise ModelLoadError(
                        f"LoRA adapter {adapter.name!r}: {prefix} shard {shard}: A {tuple(a.shape)} and B "
                        f"{tuple(b.shape)} do not fit the layer (A [{r}, {layer.input_size}], B [{size}, {r}])")
                a_cat[j * r:(j + 1) * r] = a
                b_bd[start:start + size, j * r:(j + 1) * r] = b * adapter.scale
            # transposed once here: the step multiplies x [T, in] by A^T, then by B^T
            a_t, b_t = a_cat.t().contiguous().to(self.device), b_bd.t().contiguous().to(self.device)
            half = self.dtype != torch.float32
            out[prefix] = (a_t.to(self.dtype), b_t.to(self.dtype), a_t if half else None, b_t if half else None)
        return out

    def _target(self, adapter: str, module: str) -> tuple[str, int | None]:
        """A PEFT module name -> (fw layer prefix, output shard or None): the layer itself, or the fused layer
        (`fw.layers.FUSED_PROJECTIONS`) holding it."""
        if module in self.layers:
            return module, None
        for sub, (fused, shard) in FUSED_PROJECTIONS.items():
            name = f"{module}.".replace(sub, fused)
            if sub in f"{module}." and name[:-1] in self.layers:
                return name[:-1], shard
        raise ModelLoadError(f"LoRA adapter {adapter!r} targets {module}, which is not a linear layer of this "
                             f"model that fw can adapt")

    # -- the step ------------------------------------------------------------------------

    def prepare_step(self, seqs, num_new: list[int], device: torch.device) -> None:
        """The step's rows per adapter, in the order the runner lays out the step's tokens."""
        # every adapter a request runs with is held: requests keep theirs from eviction (`_make_room`)
        slots = [self.slots[s.request.lora_name] if s.request.lora_name else None for s in seqs]
        if all(slot is None for slot in slots):
            self.step.groups = []
            self._wrap(False)
            return
        self._wrap(True)
        if len(set(slots)) == 1:
            self.step.groups = [(slots[0], None)]
            return
        rows: dict[int, list[int]] = {}
        start = 0
        for slot, n in zip(slots, num_new):
            if slot is not None:
                rows.setdefault(slot, []).extend(range(start, start + n))
            start += n
        self.step.groups = [(slot, torch.tensor(r, dtype=torch.long, device=device)) for slot, r in rows.items()]


    def _wrap(self, on: bool) -> None:
        """Steps with an adapter run the layers' LoRA methods; steps of base requests alone run the layers'
        own methods, so they cost what they would without --enable-lora. GatedMLP's fused SiLU is the layer's own
        method's (`silu_mul`), which a LoRA method does not offer: with an adapter the update must land on gate
        and up before the activation, so those steps take the unfused path (and `silu_gate_up` says so)."""
        if on == self._wrapped:
            return
        for prefix, layer in self.layers.items():
            method = self.methods[prefix]
            layer.method = method if on else method.base
            layer.silu_gate_up = self._fused_silu[prefix] and not on
        self._wrapped = on


def parse_lora_modules(entries: list[str]) -> list[tuple[str, str]]:
    """--lora-modules NAME=PATH entries -> (name, path); vLLM's form."""
    pairs = []
    for entry in entries:
        name, sep, path = entry.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--lora-modules {entry!r}: give NAME=PATH (a PEFT adapter directory)")
        pairs.append((name.strip(), path.strip()))
    return pairs
