"""What fw's choices ask of a torch device: a GPU's compute capability and name, and the guard that
makes it the current device while a step runs.

Everything here answers for the CPU without touching `torch.cuda`, so a CPU-only process never
initialises CUDA."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch


def cuda_capability(device: torch.device | str) -> tuple[int, int] | None:
    """The CUDA compute capability of `device` ((9, 0) for sm_90), None for a device that is not CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return int(major), int(minor)


def gpu_name(device: torch.device | str) -> str:
    """The GPU's name ("NVIDIA H200"), "" for a device that is not CUDA or whose name is unknown."""
    device = torch.device(device)
    if device.type != "cuda":
        return ""
    try:
        return torch.cuda.get_device_name(device)
    except (RuntimeError, AssertionError):
        return ""


def describe(device: str, capability: tuple[int, int] | None = None, name: str = "") -> str:
    """A device kind in words: "cuda sm_90 (NVIDIA H200)", "cpu"."""
    text = device + (f" sm_{capability[0]}{capability[1]}" if capability else "")
    return f"{text} ({name})" if name else text


def guard(device: torch.device) -> AbstractContextManager:
    """`device` as the current CUDA device while the block runs (a no-op off CUDA).

    Triton kernels (and any raw CUDA launch) run on the thread's current device whatever device their
    tensors are on: with `--device cuda:1` and the current device 0 they would launch on GPU 0 with
    GPU 1's pointers. torch's own ops set the device themselves."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()
