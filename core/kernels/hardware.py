"""What the CPU can do natively, for choices such as the default dtype.

Why not torch: `torch.backends.cpu.get_cpu_capability()` says "AVX512" whether or
not the CPU has bf16 dot products, and oneDNN runs bf16 on any AVX-512 CPU by
emulating it (slower than fp32). The kernel's CPU flags say what is native."""

from __future__ import annotations

import functools
import platform
from pathlib import Path

# x86: AVX512-BF16 dot products or AMX tiles; Arm: the BF16 extension (BFDOT/BFMMLA).
_NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The flags of the first CPU in a /proc/cpuinfo text ("flags" on x86, "Features" on Arm)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            return frozenset(value.split())
    return frozenset()


@functools.cache
def this_cpu_flags() -> frozenset[str]:
    """This machine's CPU flags (empty where /proc/cpuinfo cannot be read)."""
    try:
        return cpu_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        return frozenset()


@functools.cache
def cpu_has_native_bf16() -> bool:
    """True where bf16 matmuls run in hardware; False where unknown (fp32 is the safe default)."""
    if platform.system() == "Darwin":
        return False  # Apple CPUs have BF16 from M2 on, but torch's CPU bf16 kernels there are not faster
    return bool(this_cpu_flags() & _NATIVE_BF16_FLAGS)
