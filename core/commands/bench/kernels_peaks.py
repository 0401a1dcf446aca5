"""Peak memory bandwidth and matrix FLOP/s of known accelerators, for `fw bench kernels`' fractions.

Vendor datasheet figures: dense (no sparsity) tensor-core throughput for 16-bit inputs, and for
float32 the TF32 tensor-core figure where fp32 matmuls may use it, else the plain FP32 rate. Names
are matched as substrings of `torch.cuda.get_device_name()`, longest first, so "H100 PCIe" wins
over "H100". A device that is not listed (and every CPU) gets no fraction unless the user passes
`--peak-bandwidth-gbps` / `--peak-tflops`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Peak:
    """What the device can do at most; None where unknown."""

    bandwidth_gbps: float | None  # GB/s (10^9 bytes per second)
    tflops: float | None  # 10^12 FLOP/s at the benchmark's dtype
    source: str  # where the figures came from, for the report

    @property
    def known(self) -> bool:
        return self.bandwidth_gbps is not None or self.tflops is not None


# name substring -> (GB/s, {dtype: dense TFLOP/s}); 16-bit tensor-core, fp32 plain (torch keeps TF32 off)
KNOWN_DEVICES: dict[str, tuple[float, dict[str, float]]] = {
    "H100 PCIe": (2000.0, {"bfloat16": 756.0, "float16": 756.0, "float32": 51.0}),
    "H100 NVL": (3900.0, {"bfloat16": 835.0, "float16": 835.0, "float32": 60.0}),
    "H100": (3350.0, {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0}),  # SXM5 (80GB HBM3)
    "H200": (4800.0, {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0}),
    "GH200": (4000.0, {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0}),
    "B200": (8000.0, {"bfloat16": 2250.0, "float16": 2250.0, "float32": 80.0}),
    "A100-SXM4-80GB": (2039.0, {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5}),
    "A100 80GB PCIe": (1935.0, {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5}),
    "A100": (1555.0, {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5}),  # 40GB
    "L40S": (864.0, {"bfloat16": 362.0, "float16": 362.0, "float32": 91.6}),
    "L40": (864.0, {"bfloat16": 181.0, "float16": 181.0, "float32": 90.5}),
    "L4": (300.0, {"bfloat16": 121.0, "float16": 121.0, "float32": 30.3}),
    "A10G": (600.0, {"bfloat16": 70.0, "float16": 70.0, "float32": 31.2}),
    "A10": (600.0, {"bfloat16": 125.0, "float16": 125.0, "float32": 31.2}),
    "V100": (900.0, {"float16": 125.0, "float32": 15.7}),
}


def known_peak(device_name: str, dtype: str) -> Peak | None:
    """The table's figures for a device name, or None when no entry matches."""
    for key in sorted(KNOWN_DEVICES, key=len, reverse=True):
        if key in device_name:
            gbps, tflops = KNOWN_DEVICES[key]
            return Peak(gbps, tflops.get(dtype), f"table: {key}")
    return None


def resolve_peak(device_type: str, device_name: str, dtype: str, bandwidth_gbps: float | None,
                 tflops: float | None) -> Peak:
    """Flags win over the table; each figure separately, so one flag can fill a gap in the table."""
    table = known_peak(device_name, dtype) if device_type == "cuda" else None
    bw = bandwidth_gbps if bandwidth_gbps is not None else (table.bandwidth_gbps if table else None)
    tf = tflops if tflops is not None else (table.tflops if table else None)
    sources = []
    if bandwidth_gbps is not None or tflops is not None:
        sources.append("flags")
    if table and (bandwidth_gbps is None or tflops is None):
        sources.append(table.source)
    return Peak(bw, tf, " + ".join(sources) if sources else "unknown (pass --peak-bandwidth-gbps / --peak-tflops)")
