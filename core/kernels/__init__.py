"""fw's CPU kernels in one place: every C++ source (and the shared header fw_simd.h), its build and its loading,
and the Python side of each kernel (the weight layouts it packs and the calls into it).

* `loader` builds and loads a C++ operator library (the install-time build, else a run-time build kept for the
  next process); `build_record` is what identifies a build. Plugins load their own kernels through `loader`
  (docs/plugin-authors/loading.md).
* `cpu_ops` (fused norm, rotary, SiLU-gate, argmax), `dense` (fw's bf16 matmul layout), `packed_int` (4-bit and
  8-bit blocks on AVX512-VNNI), `packed_record` (repacked weights kept in fw's cache), `weight_arena` (packed
  weights on huge pages).
* Sources of kernels whose Python side lives elsewhere: `packed_linear.cpp` (fw.compile's opaque packed linear)
  and `cpu_paged.cpp` (the cpu_paged attention backend).

The shared layers (fw.layers) call these; the layers' own numerics stay the reference the kernels are tested
against."""

from pathlib import Path

SOURCE_DIR = Path(__file__).parent  # the C++ sources ship here as package data


def source(name: str) -> Path:
    """The path of one of fw's C++ sources, e.g. `source("cpu_paged.cpp")`."""
    return SOURCE_DIR / name
