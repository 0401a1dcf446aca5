"""Warm-cache artifact for a C++ operator library loaded with `fw.kernels.loader`: the
core's fused CPU ops, and any plugin's kernel (the cpu_paged attention
backend adds its own through the `fw_warm_cache_artifacts` hook).

A library built by `pip install` is a hit (nothing to build); otherwise the
run-time build is made here. A build is for the machine that runs it
(-march=native, keyed by the CPU's flags), so it is warmed only for a CPU
target on this machine; concurrent builders are serialized by fw.kernels.loader'
file lock."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import torch

from fw.kernels import cpu_ops, dense, loader, packed_int, step_program
from fw.layers import replay
from fw.warm import resolve
from fw.warm.artifact import WarmContext, WarmItem

logger = logging.getLogger("fw.warm")


class CppOpsArtifact:
    """`applies(context)` says whether the server with these flags would load the library."""

    def __init__(self, library: str, source: Path, cflags: tuple[str, ...] = loader.DEFAULT_CFLAGS,
                 owner: str = "core", applies: Callable[[WarmContext], bool] | None = None):
        self.library, self.source, self.cflags = library, source, cflags
        self.name = f"C++ ops {library}"
        self.owner = owner
        self._applies = applies

    def applies(self, context: WarmContext) -> bool:
        why = loader.unavailable(self.library, self.source, self.cflags)
        if why:
            logger.info("%s: not built (%s); the server will not use it either", self.name, why)
            return False
        return self._applies is None or self._applies(context)

    def _item(self, hit: bool) -> WarmItem:
        path = loader.library_path(self.library, self.source, self.cflags)
        installed = loader.installed(self.library, self.source, self.cflags)[0] is not None
        return WarmItem(self.library, hit, f"{path} (installed)" if installed else str(path))

    def check(self, context: WarmContext) -> list[WarmItem]:
        if not self.applies(context):
            return []
        return [self._item(loader.is_built(self.library, self.source, self.cflags))]

    def build(self, context: WarmContext) -> list[WarmItem]:
        if not self.applies(context):
            return []
        hit = loader.is_built(self.library, self.source, self.cflags)
        loader.load_cpp_ops(self.library, self.source, self.cflags)  # builds under the lock when missing
        return [self._item(hit)]


def cpu_target(context: WarmContext) -> bool:
    """The server would run on this machine's CPU."""
    return resolve.device(context).type == "cpu"


def core_cpu_ops() -> CppOpsArtifact:
    """The fused CPU layer ops of fw.kernels.cpu_ops (RMSNorm, rotary, SiLU * up, argmax)."""
    return CppOpsArtifact("cpu_ops", cpu_ops._SOURCE, cpu_ops._CFLAGS, owner="core",
                          applies=lambda context: cpu_target(context) and cpu_ops.wanted())


def core_dense_bf16() -> CppOpsArtifact:
    """fw's bf16 matmul kernel (fw.kernels.dense), for a bf16 model on a CPU with AVX512-BF16 (or a model
    whose dtype is not known yet: its files are not here)."""
    def applies(context: WarmContext) -> bool:
        return (cpu_target(context) and dense.bf16_kernel_wanted()
                and resolve.dtype(context) in (None, torch.bfloat16))

    return CppOpsArtifact("dense_bf16", dense.BF16_SOURCE, dense.BF16_CFLAGS, owner="core", applies=applies)


def core_packed_int() -> CppOpsArtifact:
    """fw's packed-int kernels (fw.kernels.packed_int) for quantized weights, on a CPU with AVX512-VNNI."""
    return CppOpsArtifact("packed_int", packed_int.SOURCE, packed_int.CFLAGS, owner="core",
                          applies=lambda context: cpu_target(context) and packed_int.wanted())


def core_step_program() -> CppOpsArtifact:
    """The C++ replay of the decoder layers' op calls (fw.kernels.step_program, fw.layers.replay), for CPU
    steps on the fused ops with an attention backend that has a step program."""
    def applies(context: WarmContext) -> bool:
        if not (cpu_target(context) and step_program.wanted() and cpu_ops.wanted()):
            return False
        name = resolve.attention_backend(context)
        if name is None:  # the model's files are not here yet: auto may choose one
            return True
        registry = context.plugins.registry("attention_backend")
        return name in registry and replay.has_step_program(registry.get(name).backend_cls)

    return CppOpsArtifact("step_program", step_program._SOURCE, step_program.DEFAULT_CFLAGS, owner="core",
                          applies=applies)
