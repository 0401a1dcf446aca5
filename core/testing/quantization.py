"""The quantization-method suite: load, apply and weight bytes of a `Linear` built through the method.

How the weights get in depends on the method:

- quantize-on-load methods (fp8, bitsandbytes-*, most third-party ones) are fed the dense
  float weight under the name `weight`, as from an unquantized checkpoint; the reference is the
  dense weight and the tolerance covers the method's rounding (`tolerance` option, default 0.1
  relative error; the built-ins have their own, tighter);
- pre-quantized formats need checkpoint tensors. The kit writes them for the built-in `gptq`
  (4-bit, group 32, symmetric, v1 zeros), `awq` (4-bit GEMM, group 32) and `gguf` (Q8_0), with
  the exactly dequantized weight as the reference (tolerance 1e-3, plus 2e-2 where the layer runs on
  fw's packed-int kernels, which quantize activations to int8). Another method passes
  `example_weights=fn`, `fn(weight [out, in] float32) -> (tensors: {param name: tensor},
  dequantized weight [out, in])`, and `quant_config=` (the checkpoint's `quantization_config`).

Checks per case (a plain layer, a fused q/k/v-style layer loaded shard by shard, a biased one):
the output equals x @ W_ref^T + b within the tolerance for decode-sized and prefill-sized
inputs, and the reported `weight_bytes` is what the layer holds, below the same weight in fp16."""

from __future__ import annotations

from typing import Any, Callable

import gguf
import numpy as np
import torch

from fw.layers import Linear, ModelContext
from fw.layers.gguf_weight import GGUFWeight
from fw.testing.suite import Case, SuiteTest, availability, device_for, stable_seed

OPTIONS = frozenset({"example_weights", "quant_config", "tolerance", "dtypes"})

GROUP = 32
# relative Frobenius error allowed against the dense weight, for built-in quantize-on-load methods
ON_LOAD_TOLERANCE = {"fp8": 0.06, "bitsandbytes-8bit": 0.03, "bitsandbytes-nf4": 0.15, "bitsandbytes-fp4": 0.2}
DEFAULT_TOLERANCE = 0.1
EXACT_TOLERANCE = 1e-3
# a layer on fw's packed-int CPU kernels (`layer.packed_int` set) quantizes its activations to int8 per block of
# 32: ~0.5% relative error on these shapes, on top of the format's own
INT8_ACTIVATIONS_TOLERANCE = 2e-2
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
# (in, output sizes, bias)
SHAPES = {"plain": (64, [64], False), "fused": (64, [32, 16, 16], False), "bias": (96, [32], True)}


def reference_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T + bias in float64: the dense reference a quantized layer is compared with."""
    out = x.double() @ weight.double().t()
    return out + bias.double() if bias is not None else out


# -- checkpoint tensors for the built-in pre-quantized formats --------------------------------------------

def _int32(words: np.ndarray) -> torch.Tensor:
    return torch.from_numpy((words & 0xFFFFFFFF).astype(np.uint32).view(np.int32).copy())


def _pack_rows(values: np.ndarray, bits: int = 4) -> torch.Tensor:
    """[R, C] -> int32 [R * bits / 32, C]: rows r*pack .. r*pack+pack-1 in one word, first lowest."""
    pack = 32 // bits
    v = values.astype(np.int64).reshape(values.shape[0] // pack, pack, values.shape[1])
    return _int32(sum(v[:, j] << (bits * j) for j in range(pack)))


def _pack_columns(values: np.ndarray, bits: int = 4, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """[R, C] -> int32 [R, C * bits / 32]; slot j of word c holds column c*pack + order[j]."""
    pack = 32 // bits
    order = order or tuple(range(pack))
    v = values.astype(np.int64).reshape(values.shape[0], values.shape[1] // pack, pack)
    return _int32(sum(v[:, :, order[j]] << (bits * j) for j in range(pack)))


def _int4_groups(w: torch.Tensor, sym: bool):
    """W [out, in] -> (codes [in, out], zeros [G, out], fp16 scales [G, out]) of per-group min-max 4-bit."""
    wt = w.t().double().numpy()
    groups = wt.reshape(-1, GROUP, wt.shape[1])
    lo, hi = np.minimum(groups.min(1), 0), np.maximum(groups.max(1), 0)
    if sym:
        hi = np.maximum(-lo, hi)
        lo = -hi
    scales = ((hi - lo) / 15).astype(np.float16)
    scales[scales == 0] = 1
    s = scales.astype(np.float64)
    zeros = np.full(s.shape, 8) if sym else np.clip(np.round(-lo / s), 0, 15)
    codes = np.clip(np.round(groups / s[:, None]) + zeros[:, None], 0, 15).reshape(wt.shape)
    deq = ((codes.reshape(groups.shape) - zeros[:, None]) * s[:, None]).reshape(wt.shape).T
    return codes.astype(np.int64), zeros.astype(np.int64), torch.from_numpy(scales), torch.from_numpy(deq).float()


def gptq_weights(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    codes, zeros, scales, deq = _int4_groups(w, sym=True)
    tensors = {"qweight": _pack_rows(codes), "qzeros": _pack_columns(zeros - 1),  # v1 stores zero - 1
               "scales": scales, "g_idx": torch.arange(w.shape[1], dtype=torch.int32) // GROUP}
    return tensors, deq


def awq_weights(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    codes, zeros, scales, deq = _int4_groups(w, sym=False)
    order = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's GEMM packing order
    return {"qweight": _pack_columns(codes, order=order), "qzeros": _pack_columns(zeros, order=order),
            "scales": scales}, deq


def gguf_weights(w: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor]:
    kind = gguf.GGMLQuantizationType.Q8_0
    data = gguf.quants.quantize(w.float().numpy(), kind)
    deq = torch.from_numpy(np.asarray(gguf.quants.dequantize(data, kind), dtype=np.float32)).reshape(w.shape)
    packed = GGUFWeight(torch.from_numpy(np.ascontiguousarray(data)).view(torch.uint8).reshape(w.shape[0], -1),
                        int(kind), "Q8_0", tuple(w.shape))
    return {"weight": packed}, deq


# method name -> (quant_config, example_weights)
BUILTIN_FORMATS: dict[str, tuple[dict, Callable]] = {
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": True,
              "checkpoint_format": "gptq"}, gptq_weights),
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": GROUP, "version": "gemm", "zero_point": True},
            awq_weights),
    "gguf": ({}, gguf_weights),
}


def _on_load(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    return {"weight": w.clone()}, w


# -- the suite ----------------------------------------------------------------------------------------------

def tests(spec: Any, options: dict) -> list[SuiteTest]:
    device = device_for(spec, options)
    if options.get("example_weights") is not None:
        quant_config, make, tolerance = options.get("quant_config") or {}, options["example_weights"], EXACT_TOLERANCE
    elif spec.name in BUILTIN_FORMATS and options.get("quant_config") is None:
        (quant_config, make), tolerance = BUILTIN_FORMATS[spec.name], EXACT_TOLERANCE
    else:
        quant_config, make = options.get("quant_config") or {}, _on_load
        tolerance = ON_LOAD_TOLERANCE.get(spec.name, DEFAULT_TOLERANCE)
    tolerance = float(options.get("tolerance") or tolerance)
    dtypes = list(options.get("dtypes") or ("float32", "bfloat16"))
    why = availability(spec)
    if why is None and device not in spec.devices:
        why = f"device {device!r} not supported (supports {', '.join(spec.devices)})"
    cases = [Case(f"{shape}-{_SHORT[dtype]}", {"shape": shape, "dtype": dtype}, why)
             for dtype in dtypes for shape in (SHAPES if dtype == dtypes[0] else ("fused",))]

    def build(case: Case):
        in_size, outs, bias = SHAPES[case.data["shape"]]
        dtype = _DTYPES[case.data["dtype"]]
        ctx = ModelContext(dtype, torch.device(device), attention_backend=None, linear_method=spec.factory(quant_config))
        layer = Linear(in_size, outs if len(outs) > 1 else outs[0], ctx, "model.layers.0.self_attn.qkv_proj", bias=bias)
        gen = torch.Generator().manual_seed(stable_seed(case.id))
        parts = []
        for shard, rows in enumerate(outs):
            w = torch.randn(rows, in_size, generator=gen) * in_size ** -0.5
            if dtype != torch.float32:
                w = w.to(dtype).float()  # what a checkpoint in this dtype can hold
            tensors, ref = make(w)
            for name, tensor in tensors.items():
                if name == "weight" and isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
                    tensor = tensor.to(dtype)
                layer.load_weight(name, tensor, shard if len(outs) > 1 else None)
            parts.append(ref.float())
        b = None
        if bias:
            b = (torch.randn(layer.output_size, generator=gen) * 0.1).to(dtype)
            layer.load_weight("bias", b)
        layer.method.process_weights_after_loading(layer)
        layer.to(device)
        return layer, torch.cat(parts), b, gen

    def apply(case: Case) -> None:
        layer, w, b, gen = build(case)
        dtype = _DTYPES[case.data["dtype"]]
        tol = tolerance + (0.0 if dtype == torch.float32 else 2e-2)
        if getattr(layer, "packed_int", None) is not None:
            tol += INT8_ACTIVATIONS_TOLERANCE
        for rows in (1, 9):
            x = torch.randn(rows, layer.input_size, generator=gen).to(dtype)
            with torch.inference_mode():
                got = layer(x.to(device)).double().cpu()
            want = reference_linear(x, w, b)
            if tuple(got.shape) != tuple(want.shape):
                raise AssertionError(f"{case.id}: output shape {tuple(got.shape)} != {tuple(want.shape)}")
            error = float((got - want).norm() / want.norm())
            if not error <= tol:  # catches NaN too
                worst = (got - want).abs()
                flat = int(worst.nan_to_num(float("inf")).argmax())
                raise AssertionError(
                    f"{case.id}: {rows} row(s): relative error {error:.4g} > tolerance {tol:g}; worst element "
                    f"|diff| = {float(worst.reshape(-1)[flat]):.4g} at [row {flat // want.shape[1]}, output "
                    f"{flat % want.shape[1]}]")

    def weight_bytes(case: Case) -> None:
        layer, *_ = build(case)
        held, dense = layer.method.weight_bytes(layer), layer.input_size * layer.output_size * 2
        if not 0 < held < dense:
            raise AssertionError(f"{case.id}: weight_bytes reports {held} bytes; the same weight in fp16 is {dense} "
                                 f"bytes, and a quantized one must be smaller (and more than 0)")
        tensors = {name: t for name, t in [*layer.named_parameters(recurse=False), *layer.named_buffers(recurse=False)]
                   if name != "bias" and t is not None}
        actual = sum(t.numel() * t.element_size() for t in tensors.values())
        if held != actual:
            listing = ", ".join(f"{n} {t.numel() * t.element_size()}" for n, t in sorted(tensors.items()))
            raise AssertionError(f"{case.id}: weight_bytes reports {held} bytes, but the layer holds {actual} bytes "
                                 f"of weight tensors ({listing}); report what the layer keeps in memory")

    bytes_cases = [c for c in cases if c.data["dtype"] == dtypes[0]][:2]
    return [
        SuiteTest("test_apply_matches_reference", apply, cases,
                  "The layer's output equals x @ W^T + b with the reference weight, within the method's tolerance."),
        SuiteTest("test_weight_bytes", weight_bytes, bytes_cases,
                  "Reported weight bytes are what the layer holds, and below fp16 dense."),
    ]
