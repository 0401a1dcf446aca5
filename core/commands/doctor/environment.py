"""`fw doctor`'s environment facts: Python, torch and its build, the CPU (name, cores, the ISA
flags that decide fast paths), CUDA devices, fw and the packages fw's plugins lean on.

Why these: they are what decides `--dtype auto`, which attention backends can run, and what a
bug report needs; everything is read locally (no network) in well under a second."""

from __future__ import annotations

import importlib.metadata as md
import os
import platform
import sys
from pathlib import Path
from typing import Any

import torch

from fw.kernels.hardware import cpu_flags, cpu_has_native_bf16
from fw.version import PLUGIN_API_VERSION, __version__

# CPU flags worth showing: the vector ISA levels, and the bf16/int8 dot products and tiles that
# decide `--dtype auto` and the speed of CPU kernels (x86 names, then Arm's).
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8",
             "asimd", "sve", "sve2", "bf16", "i8mm")

PACKAGES = ("transformers", "tokenizers", "safetensors", "huggingface-hub", "gguf", "pluggy", "xgrammar",
            "outlines-core", "bitsandbytes", "triton")


def _read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def cpu_facts(cpuinfo: str | None = None, meminfo: str | None = None) -> dict[str, Any]:
    """Name, cores and ISA flags from /proc/cpuinfo (empty where the file is not readable)."""
    cpuinfo = _read("/proc/cpuinfo") if cpuinfo is None else cpuinfo
    meminfo = _read("/proc/meminfo") if meminfo is None else meminfo
    name = None
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("model name", "hardware", "cpu model"):
            name = value.strip()
            break
    flags = cpu_flags(cpuinfo)
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    memory = None
    for line in meminfo.splitlines():
        if line.startswith("MemTotal:"):
            memory = int(line.split()[1]) * 1024
            break
    return {
        "name": name or platform.processor() or platform.machine(),
        "architecture": platform.machine(),
        "logical_cores": os.cpu_count(),
        "usable_cores": usable,
        "isa_flags": [f for f in ISA_FLAGS if f in flags],
        "native_bf16": cpu_has_native_bf16(),
        "memory_bytes": memory,
    }


def torch_facts() -> dict[str, Any]:
    cuda, hip = torch.version.cuda, getattr(torch.version, "hip", None)
    build = f"CUDA {cuda}" if cuda else f"ROCm {hip}" if hip else "CPU"
    devices = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            devices.append({"index": i, "name": props.name, "capability": f"{props.major}.{props.minor}",
                            "memory_bytes": int(props.total_memory)})
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:  # older torch
        capability = None
    return {"version": torch.__version__, "build": build, "cuda_available": bool(devices),
            "cuda_devices": devices, "cpu_capability": capability, "threads": torch.get_num_threads()}


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def environment() -> dict[str, Any]:
    return {
        "python": {"version": platform.python_version(), "implementation": platform.python_implementation(),
                   "executable": sys.executable},
        "platform": platform.platform(),
        "torch": torch_facts(),
        "cpu": cpu_facts(),
        "fw": {"version": __version__, "plugin_api_version": PLUGIN_API_VERSION},
        "packages": package_versions(),
    }


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


def format_environment(env: dict[str, Any]) -> list[str]:
    """The environment as `name  value` lines."""
    t, c = env["torch"], env["cpu"]
    cuda = ("; ".join(f"cuda:{d['index']} {d['name']} (sm {d['capability']}, {_gib(d['memory_bytes'])})"
                      for d in t["cuda_devices"]) or "none")
    packages = ", ".join(f"{n} {v}" for n, v in env["packages"].items() if v) or "-"
    missing = ", ".join(n for n, v in env["packages"].items() if not v)
    rows = [
        ("python", f"{env['python']['version']} ({env['python']['executable']})"),
        ("platform", env["platform"]),
        ("torch", f"{t['version']} ({t['build']} build; CPU capability {t['cpu_capability'] or '?'}; "
                  f"{t['threads']} threads)"),
        ("cpu", f"{c['name']} ({c['architecture']}): {c['logical_cores']} logical cores, {c['usable_cores']} usable; "
                f"memory {_gib(c['memory_bytes'])}"),
        ("cpu isa", f"{' '.join(c['isa_flags']) or '(not readable)'}; "
                    f"native bf16: {'yes' if c['native_bf16'] else 'no'}"),
        ("cuda", cuda),
        ("fw", f"{env['fw']['version']} (plugin API {env['fw']['plugin_api_version']})"),
        ("packages", packages + (f"; not installed: {missing}" if missing else "")),
    ]
    return [f"  {name:<10} {value}" for name, value in rows]
