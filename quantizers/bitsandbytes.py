"""The bitsandbytes quantization methods: `bitsandbytes-8bit`, `bitsandbytes-nf4`, `bitsandbytes-fp4`.

Quantizing, dequantizing and the 4-bit matmul are the bitsandbytes library's own functions (it runs on
CPU too); nothing here re-implements its formats. Two ways in, one layout in memory per mode:
- `--quantization NAME` on a float checkpoint (or a GGUF file, whose tensors arrive dequantized): each
  checkpoint tensor is quantized as it loads, so the dense model never exists in full.
  4-bit: `quantize_4bit` with blocksize 64, one fp32 absmax per block, no double quantization
  (transformers' default). 8-bit: LLM.int8's row-wise absmax (`int8_vectorwise_quant` of the fp16
  weight, as `bnb.nn.Int8Params` does), int8 weight + one fp32 scale (`SCB`) per row.
- checkpoints transformers saved with a `BitsAndBytesConfig` (`quant_method: "bitsandbytes"`):
  4-bit `weight` (packed uint8) + `weight.absmax`, `weight.quant_map`, optional `weight.nested_absmax` /
  `weight.nested_quant_map`, and `weight.quant_state.bitsandbytes__{nf4,fp4}` (JSON); 8-bit `weight`
  (int8) + `SCB` (+ `weight_format`). Double-quantized absmax is expanded to fp32 at load (0.375 bit a
  parameter more) so fused q/k/v and gate/up shards can share one quant state.

The matmul: 4-bit runs `bnb.matmul_4bit` on CUDA; on a bf16 CPU model with AVX512-BF16 the library's
fused CPU kernel (`bnb_cpu_kernel`); otherwise on CPU it dequantizes with `dequantize_4bit` and
multiplies, as `matmul_4bit` itself does there, but describing the weight as one flat row (see
`FourBitLinearMethod.quant_states`: the library's AVX-512 kernel miscounts blocks when a row is no
multiple of 64). 8-bit dequantizes per matmul on CPU (`int8_vectorwise_dequant`): the library's
LLM.int8 matmul also quantizes the activations to int8 per row after casting them to fp16, which costs
accuracy and, on CPU, time; on CUDA it runs `bnb.matmul` with the configured outlier threshold
(`llm_int8_threshold`, 6.0). `FW_BNB_INT8_MATMUL=1` forces the library matmul on CPU too (see
docs/choices.md). On a CPU with fw's packed kernels the int8 codes stay packed: widened to bf16 in registers
where AVX512-BF16 and -VBMI are there (W8A16, the dequantize-then-matmul's numbers), else on the 8-bit kernel,
which rounds the activations to int8 (W8A8). `lm_head` and `llm_int8_skip_modules` stay unquantized, as in transformers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from fw import env
from fw.errors import ModelLoadError, UnsupportedConfigurationError
from fw.layers import Linear
from fw.kernels import packed_int
from fw.layers.linear import LinearMethod, UnquantizedLinearMethod
from fw.plugins import QuantizationMethodSpec, Verified, hookimpl
from fw.quantizers import bnb_cpu_kernel
from fw.quantizers._packing import skipped_in_checkpoint

FW_PLUGIN_API_VERSION = "1.2"  # verified_on

MODES = {"bitsandbytes-8bit": "8bit", "bitsandbytes-nf4": "nf4", "bitsandbytes-fp4": "fp4"}
BLOCKSIZE = 64
INT8_THRESHOLD = 6.0
_STATE_KEYS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")  # 4-bit `weight.<key>` tensors


def missing_reason() -> str | None:
    """Why the methods cannot run here (bitsandbytes not importable), or None."""
    try:
        _bnb()
    except Exception as exc:  # ImportError, or a broken native library
        return f"the bitsandbytes library is not usable ({exc}); install it with `pip install fw[bitsandbytes]`"
    return None


def _bnb():
    # On AVX512-BF16 CPUs bitsandbytes tries, at import, to fetch a faster 4-bit kernel from the Hugging Face
    # Hub (the `kernels` package) and warns when it cannot; fw runs offline and uses the library's built-in
    # CPU kernel instead, so that warning would only alarm users.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    import bitsandbytes  # here: bitsandbytes costs start-up time; only its methods' layers need it

    return bitsandbytes


def checkpoint_mode(qcfg: dict) -> str | None:
    """'8bit', 'nf4' or 'fp4' for a transformers `BitsAndBytesConfig` dict; None for other formats."""
    if str(qcfg.get("quant_method", "")).lower() != "bitsandbytes":
        return None
    if qcfg.get("load_in_8bit") or qcfg.get("_load_in_8bit"):
        return "8bit"
    if qcfg.get("load_in_4bit") or qcfg.get("_load_in_4bit"):
        return str(qcfg.get("bnb_4bit_quant_type") or "fp4").lower()
    return None


@dataclass(frozen=True)
class BnbSettings:
    mode: str  # 8bit | nf4 | fp4
    prequantized: bool  # the checkpoint holds bitsandbytes tensors
    skip_modules: tuple[str, ...] = ("lm_head",)
    threshold: float = INT8_THRESHOLD


class BitsAndBytesMethod:
    """The model-wide method: picks the per-layer method (`method_for`)."""

    def __init__(self, settings: BnbSettings):
        self.settings = settings
        self._quantized = Int8LinearMethod(settings) if settings.mode == "8bit" else FourBitLinearMethod(settings)

    def method_for(self, prefix: str) -> LinearMethod:
        skips = self.settings.skip_modules
        if skipped_in_checkpoint(prefix, lambda name: any(s in name.split(".") or name.endswith(s) for s in skips)):
            return UnquantizedLinearMethod()
        return self._quantized


def make_factory(name: str):
    mode = MODES[name]

    def factory(qcfg: dict) -> BitsAndBytesMethod:
        found = checkpoint_mode(qcfg or {})
        if qcfg and found is None:
            raise UnsupportedConfigurationError(
                f"--quantization {name} quantizes a float checkpoint while loading, but this checkpoint is "
                f"already quantized ({qcfg.get('quant_method', 'unknown method')}); drop --quantization or "
                f"load an unquantized checkpoint")
        if found is not None and found != mode:
            wanted = {"8bit": "bitsandbytes-8bit", "nf4": "bitsandbytes-nf4", "fp4": "bitsandbytes-fp4"}.get(found)
            raise UnsupportedConfigurationError(
                f"the checkpoint is bitsandbytes {found} but --quantization {name} was given; "
                + (f"use --quantization {wanted} or leave the flag out" if wanted else
                   f"bnb_4bit_quant_type {found!r} is not supported (nf4 or fp4)"))
        skip = tuple((qcfg or {}).get("llm_int8_skip_modules") or ()) + ("lm_head",)
        threshold = float((qcfg or {}).get("llm_int8_threshold") or INT8_THRESHOLD)
        return BitsAndBytesMethod(BnbSettings(mode, found is not None, skip, threshold))

    return factory


def _shard_rows(layer: Linear, shard: int | None) -> int:
    return layer.output_sizes[0 if shard is None else shard]


def _check_float(layer: Linear, tensor: torch.Tensor, shard: int | None) -> None:
    expected = (_shard_rows(layer, shard), layer.input_size)
    if tuple(tensor.shape) != expected:
        raise ModelLoadError(f"{layer.prefix}.weight" + (f"[shard {shard}]" if shard is not None else "")
                             + f": checkpoint shape {tuple(tensor.shape)} != expected {expected}")
    if not tensor.is_floating_point():
        raise ModelLoadError(f"{layer.prefix}.weight: on-the-fly bitsandbytes quantization needs a float "
                             f"tensor, got {tensor.dtype}; is the checkpoint already quantized?")


class FourBitLinearMethod(LinearMethod):
    """nf4 / fp4: packed uint8 weight (two 4-bit codes a byte) + fp32 absmax per block of 64."""

    def __init__(self, settings: BnbSettings):
        self.settings = settings

    def create_weights(self, layer: Linear) -> None:
        # Replaced by the packed weight of all shards in process_weights_after_loading.
        layer.weight = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        layer.bnb_shards = [None] * len(layer.output_sizes)  # per shard: (packed, QuantState)
        if self.settings.prequantized:
            layer.bnb_parts = [{} for _ in layer.output_sizes]  # per shard: checkpoint tensors by key
            _attach_state_holder(layer)

    def load_weight(self, layer: Linear, param_name: str, tensor: torch.Tensor, shard: int | None) -> None:
        index = 0 if shard is None else shard
        if self.settings.prequantized:
            if param_name != "weight" and not param_name.startswith("weight."):
                raise ModelLoadError(f"{layer.prefix}.{param_name}: not a bitsandbytes 4-bit tensor")
            layer.bnb_parts[index][param_name] = tensor
            return
        if param_name != "weight":
            return super().load_weight(layer, param_name, tensor, shard)
        _check_float(layer, tensor, shard)
        packed, state = _bnb().functional.quantize_4bit(
            tensor.to(layer.params_dtype).contiguous(), blocksize=BLOCKSIZE, quant_type=self.settings.mode)
        layer.bnb_shards[index] = (packed, state)

    def process_weights_after_loading(self, layer: Linear) -> None:
        if self.settings.prequantized:
            layer.bnb_shards = [_state_from_checkpoint(layer, i, parts, self.settings.mode)
                                for i, parts in enumerate(layer.bnb_parts)]
            del layer.bnb_parts
            layer._modules.pop("weight", None)
        missing = [i for i, s in enumerate(layer.bnb_shards) if s is None]
        if missing:
            raise ModelLoadError(f"{layer.prefix}: checkpoint lacks the weight of shard(s) {missing}")
        F = _bnb().functional
        for i, (packed, state) in enumerate(layer.bnb_shards):
            if tuple(state.shape) != (layer.output_sizes[i], layer.input_size):
                raise ModelLoadError(f"{layer.prefix}[shard {i}]: quantized shape {tuple(state.shape)} != "
                                     f"expected {(layer.output_sizes[i], layer.input_size)}")
            if state.quant_type != self.settings.mode:
                raise ModelLoadError(f"{layer.prefix}: tensor is {state.quant_type}, the config says "
                                     f"{self.settings.mode}")
            if not torch.equal(state.code.float(), layer.bnb_shards[0][1].code.float()):
                raise ModelLoadError(f"{layer.prefix}: the fused shards' 4-bit code tables (quant_map) differ")
        absmaxes = [_flat_absmax(F, s) for _, s in layer.bnb_shards]
        # Blocks never straddle a shard boundary when every shard's size is a multiple of its blocksize:
        # then the shards' packed bytes and absmax concatenate into one tensor with one quant state.
        first = layer.bnb_shards[0][1]
        mergeable = all(s.blocksize == first.blocksize and s.shape.numel() % s.blocksize == 0
                        for _, s in layer.bnb_shards)
        if mergeable:
            groups = [list(range(len(layer.bnb_shards)))]
        else:
            groups = [[i] for i in range(len(layer.bnb_shards))]
        layer.weight = nn.Parameter(torch.cat([p.reshape(-1) for p, _ in layer.bnb_shards]).reshape(-1, 1),
                                    requires_grad=False)
        layer.register_buffer("weight_absmax", torch.cat(absmaxes))
        layer.register_buffer("weight_quant_map", first.code.clone())
        layer.bnb_groups = []  # (packed start, packed size, absmax start, absmax size, rows, blocksize)
        p0 = a0 = 0
        for group in groups:
            rows = sum(layer.output_sizes[i] for i in group)
            psize = sum(layer.bnb_shards[i][0].numel() for i in group)
            asize = sum(absmaxes[i].numel() for i in group)
            layer.bnb_groups.append((p0, psize, a0, asize, rows, layer.bnb_shards[group[0]][1].blocksize))
            p0, a0 = p0 + psize, a0 + asize
        layer.bnb_cache = {}  # flat -> (absmax it was built for, [QuantState])
        del layer.bnb_shards
        layer.bnb_cpu = None
        if self._fused_cpu_kernel_applies(layer):
            self._repack_for_cpu_kernel(layer)

    def _fused_cpu_kernel_applies(self, layer: Linear) -> bool:
        """bitsandbytes' own fused CPU 4-bit matmul (`fw.quantizers.bnb_cpu_kernel`; any number of rows): a
        bf16 model on the CPU, each group of rows a multiple of 32 and each row whole blocks (its repack's
        rules), and `FW_CPU_PACKED_INT` not 0. Else the reference path: dequantize, then `F.linear`."""
        if layer.device.type != "cpu" or layer.params_dtype != torch.bfloat16 or not packed_int.cpu_kernels_enabled():
            return False
        if not bnb_cpu_kernel.available(_bnb()):
            return False
        return all(rows % 32 == 0 and layer.input_size % blocksize == 0
                   for *_, rows, blocksize in layer.bnb_groups)

    def _repack_for_cpu_kernel(self, layer: Linear) -> None:
        """Each group in the layout of bitsandbytes' CPU kernel, replacing the flat weight and absmax."""
        packed = [layer.weight[p0:p0 + psize] for p0, psize, *_ in layer.bnb_groups]
        weight, absmax, groups = bnb_cpu_kernel.repack(_bnb(), packed, self.quant_states(layer, False))
        layer.weight = nn.Parameter(weight, requires_grad=False)
        layer.weight_absmax = absmax
        layer.bnb_cpu = bnb_cpu_kernel.CpuGemv4bit(_bnb(), groups, layer.input_size, self.settings.mode)
        layer.bnb_cache = {}

    def quant_states(self, layer: Linear, flat: bool) -> list:
        """One bitsandbytes QuantState per group of merged shards, on the weight's device (cached).

        `flat` states describe each group as one row [1, rows * in]: bitsandbytes 0.50's AVX-512 CPU
        `dequantize_4bit` indexes blocks per row, which is wrong when a row is no multiple of the
        blocksize (the format, and the library's CUDA and pure-torch paths, count blocks over the
        flattened tensor); with one row both agree, and the result is reshaped."""
        cache = layer.bnb_cache.get(flat)
        if cache is not None and cache[0] is layer.weight_absmax:
            return cache[1]
        QuantState = _bnb().functional.QuantState
        states = []
        for _, _, a0, asize, rows, blocksize in layer.bnb_groups:
            shape = [1, rows * layer.input_size] if flat else [rows, layer.input_size]
            states.append(QuantState(absmax=layer.weight_absmax[a0:a0 + asize], shape=torch.Size(shape),
                                     code=layer.weight_quant_map, blocksize=blocksize,
                                     quant_type=self.settings.mode, dtype=layer.params_dtype))
        layer.bnb_cache[flat] = (layer.weight_absmax, states)
        return states

    def dequantized(self, layer: Linear) -> torch.Tensor:
        """The dense weight [out, in] in the model dtype, with the library's `dequantize_4bit`."""
        F = _bnb().functional
        if layer.bnb_cpu is not None:
            return layer.bnb_cpu.dequantized().to(layer.params_dtype)
        parts = [F.dequantize_4bit(layer.weight[p0:p0 + psize], state).view(rows, layer.input_size)
                 for (p0, psize, _, _, rows, _), state in zip(layer.bnb_groups, self.quant_states(layer, True))]
        return torch.cat(parts).to(layer.params_dtype)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.bnb_cpu is not None:
            out = layer.bnb_cpu(x)
            return out if layer.bias is None else out + layer.bias
        if x.device.type != "cuda":  # what bnb.matmul_4bit does on CPU, with the flat dequantize
            return torch.nn.functional.linear(x, self.dequantized(layer).to(x.dtype), layer.bias)
        bnb = _bnb()
        outs = [bnb.matmul_4bit(x, layer.weight[p0:p0 + psize].t(), state)
                for (p0, psize, *_), state in zip(layer.bnb_groups, self.quant_states(layer, False))]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return out if layer.bias is None else out + layer.bias

    def weight_bytes(self, layer: Linear) -> int:
        return sum(t.numel() * t.element_size() for t in (layer.weight, layer.weight_absmax, layer.weight_quant_map))


def _flat_absmax(F, state) -> torch.Tensor:
    """fp32 absmax per block; a double-quantized one is dequantized as `dequantize_4bit` does it."""
    if state.nested:
        return (F.dequantize_blockwise(state.absmax, state.state2) + state.offset).float()
    return state.absmax.float()


class _SerializedStateHolder(nn.Module):
    """Receives a 4-bit checkpoint's `<layer>.weight.<key>` tensors.

    fw's loader routes a checkpoint tensor to the module named by everything before its last dot, so
    `q_proj.weight.absmax` needs a module `q_proj.weight` (and `...weight.quant_state` for the JSON
    state). This holder sits under the layer's `_modules["weight"]` beside the `weight` parameter
    until loading ends, then it is removed. Its parameters are placeholders; tensors go to the layer."""

    def __init__(self, layer: Linear, keys: tuple[str, ...], prefix: str = "weight"):
        super().__init__()
        self._target = [layer]  # a list, so the layer is not registered as a submodule (a cycle)
        self._prefix = prefix
        for key in keys:
            self.register_parameter(key, nn.Parameter(torch.empty(0), requires_grad=False))

    def load_weight(self, param_name: str, tensor: torch.Tensor, shard: int | None = None) -> None:
        layer = self._target[0]
        layer.method.load_weight(layer, f"{self._prefix}.{param_name}", tensor, shard)


def _attach_state_holder(layer: Linear) -> None:
    holder = _SerializedStateHolder(layer, _STATE_KEYS)
    holder.add_module("quant_state", _SerializedStateHolder(
        layer, ("bitsandbytes__nf4", "bitsandbytes__fp4"), prefix="weight.quant_state"))
    layer._modules["weight"] = holder  # beside the `weight` parameter; see _SerializedStateHolder


def _state_from_checkpoint(layer: Linear, index: int, parts: dict, mode: str):
    """(packed, QuantState) of one shard from its checkpoint tensors, with bitsandbytes' own deserializer."""
    name = f"{layer.prefix}.weight" + (f"[shard {index}]" if len(layer.output_sizes) > 1 else "")
    if "weight" not in parts:
        raise ModelLoadError(f"{name}: the checkpoint lacks the packed 4-bit weight")
    packed = parts.pop("weight")
    if packed.dtype != torch.uint8:
        raise ModelLoadError(f"{name}: a bitsandbytes 4-bit weight is uint8, got {packed.dtype}; does the "
                             f"checkpoint's quantization_config match its tensors?")
    qs = {k.removeprefix("weight."): v for k, v in parts.items()}
    if not any(k.startswith("quant_state.") for k in qs):
        raise ModelLoadError(f"{name}: the checkpoint lacks weight.quant_state.bitsandbytes__{mode}")
    try:
        state = _bnb().functional.QuantState.from_dict(qs, device=torch.device("cpu"))
    except (ValueError, KeyError, AssertionError) as exc:
        raise ModelLoadError(f"{name}: unreadable bitsandbytes quant state: {exc}") from None
    return packed, state


def _int8_matmul_forced() -> bool:
    """FW_BNB_INT8_MATMUL=1: bitsandbytes' own LLM.int8 matmul on any device (the CUDA default)."""
    return env.BNB_INT8_MATMUL.get()


class Int8LinearMethod(packed_int.PackedIntSteps, LinearMethod):
    """LLM.int8 weights: int8 [out, in] + fp32 row scale `SCB` (absmax of the row)."""

    def __init__(self, settings: BnbSettings):
        self.settings = settings

    def create_weights(self, layer: Linear) -> None:
        layer.weight = nn.Parameter(torch.empty(layer.output_size, layer.input_size, dtype=torch.int8),
                                    requires_grad=False)
        scb = torch.zeros(layer.output_size, dtype=torch.float32)
        if self.settings.prequantized:  # in the checkpoint: parameters (every parameter must be loaded)
            layer.SCB = nn.Parameter(scb, requires_grad=False)
            layer.weight_format = nn.Parameter(torch.zeros((), dtype=torch.uint8), requires_grad=False)
        else:
            layer.register_buffer("SCB", scb)

    def load_weight(self, layer: Linear, param_name: str, tensor: torch.Tensor, shard: int | None) -> None:
        if param_name == "weight_format":
            if int(tensor) != 0:  # 0 = row-major, the only layout bitsandbytes >= 0.45 writes
                raise ModelLoadError(f"{layer.prefix}.weight_format is {int(tensor)}; only the row-major "
                                     f"layout (0) is supported: re-save the checkpoint with bitsandbytes >= 0.45")
            return
        if param_name == "weight" and not self.settings.prequantized:
            _check_float(layer, tensor, shard)
            cb, scb, _ = _bnb().functional.int8_vectorwise_quant(tensor.to(torch.float16).contiguous())
            super().load_weight(layer, "weight", cb, shard)
            start = sum(layer.output_sizes[:shard]) if shard is not None else 0
            layer.SCB.narrow(0, start, scb.numel()).copy_(scb)
            return
        if param_name == "weight" and tensor.dtype != torch.int8:
            raise ModelLoadError(f"{layer.prefix}.weight: a bitsandbytes 8-bit weight is int8, got {tensor.dtype}")
        super().load_weight(layer, param_name, tensor, shard)

    def process_weights_after_loading(self, layer: Linear) -> None:
        if "weight_format" in layer._parameters:
            del layer._parameters["weight_format"]
        layer.bnb_state = None
        layer.packed_int = None
        if not _int8_matmul_forced() and packed_int.applies(layer.device, layer.input_size):
            # fw's kernels take the int8 codes as they are and the row scale absmax / 127 per block of 32. Where
            # the widening kernel is built, the codes become bf16 in registers and meet the activations as they
            # are (W8A16: what the reference path's dequantize-then-matmul computes, and faster at decode sizes);
            # elsewhere the 8-bit kernel rounds the activations to int8 (W8A8). Figures: docs/quantization.md.
            scale = (layer.SCB.float() / 127).unsqueeze(1).expand(-1, layer.input_size // packed_int.BLOCK)
            if packed_int.applies(layer.device, layer.input_size, widening=True):
                blocks = packed_int.WideInt8Blocks(layer.weight.data, scale.contiguous())
            else:
                blocks = packed_int.QuantBlocks(8, layer.weight.data, scale)
            weight = packed_int.pack(blocks)
            layer.weight = nn.Parameter(weight.data, requires_grad=False)
            layer.packed_int = [weight]

    def dequantized(self, layer: Linear) -> torch.Tensor:
        """The dense weight [out, in] in the model dtype, with the library's `int8_vectorwise_dequant`."""
        if layer.packed_int is not None:
            raise RuntimeError(f"{layer.prefix}: repacked for fw's packed-int kernels; the int8 matrix is gone")
        return _bnb().functional.int8_vectorwise_dequant(layer.weight, layer.SCB).to(layer.params_dtype)

    def uses_int8_matmul(self, layer: Linear, x: torch.Tensor) -> bool:
        return _int8_matmul_forced() or x.device.type == "cuda"

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.packed_int is not None:
            return packed_int.layer_forward(layer, x)
        if not self.uses_int8_matmul(layer, x):
            return torch.nn.functional.linear(x, self.dequantized(layer).to(x.dtype), layer.bias)
        bnb = _bnb()
        state = layer.bnb_state
        if state is None or state.CB is not layer.weight or state.SCB is not layer.SCB:  # rebuilt after .to()
            state = bnb.MatmulLtState()
            state.CB, state.SCB = layer.weight, layer.SCB
            state.threshold = self.settings.threshold
            state.has_fp16_weights = False
            state.is_training = False
            layer.bnb_state = state
        bias = None if layer.bias is None else layer.bias.to(x.dtype)
        return bnb.matmul(x, layer.weight, bias=bias, state=state)

    def weight_bytes(self, layer: Linear) -> int:
        return layer.weight.numel() * layer.weight.element_size() + layer.SCB.numel() * layer.SCB.element_size()


VERIFIED_CPU = Verified("cpu", by="fw's CPU tests")
VERIFIED_H200 = Verified("cuda", (9, 0), "NVIDIA H200", "2026-11-25", "scripts/gpu_acceptance.sh")


@hookimpl
def fw_register_quantization_methods(register) -> None:
    for name, mode in MODES.items():
        register(QuantizationMethodSpec(
            name=name,
            factory=make_factory(name),
            detects=lambda qcfg, mode=mode: checkpoint_mode(qcfg) == mode,
            devices=("cpu", "cuda"),
            available=missing_reason,
            # tests/test_gpu_quantized.py ran 8-bit and nf4 on CUDA; fp4 has not run on a GPU
            verified_on=(VERIFIED_CPU,) + ((VERIFIED_H200,) if mode != "fp4" else ()),
            description=("bitsandbytes LLM.int8 row-wise int8 weights" if mode == "8bit" else
                         f"bitsandbytes {mode} 4-bit weights, blocksize 64")
                        + ": quantize on load or read transformers' bitsandbytes checkpoints",
        ))
