"""Which `--compile-mode`s fw can run on which device.

`reduce-overhead` and `max-autotune` make Inductor capture CUDA graphs. fw's compiled step cannot be
replayed from a graph yet: its attention and MoE operators (`fw_compile::attention`,
`fw_compile::moe_experts`, fw.compile.ops) run the plugin's kernels outside the graph on per-step Python
metadata (block tables, slot mapping, lengths) and write the KV cache without declaring it, so a replay
would attend and write with the captured step's pages. vLLM makes this safe by splitting the graph
piecewise around attention; until fw does, these modes are refused on CUDA with that reason. On the CPU
they capture nothing and run like `default`."""

from __future__ import annotations

from fw.errors import UnsupportedConfigurationError

# The modes whose Inductor options set `triton.cudagraphs` (torch._inductor.list_mode_options; a test checks it).
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def cuda_graph_refusal(mode: str | None, device_type: str) -> str | None:
    """Why `--compile-mode mode` cannot run on a `device_type` device, or None when it can."""
    if mode not in CUDA_GRAPH_MODES or device_type != "cuda":
        return None
    alternative = "max-autotune-no-cudagraphs" if mode == "max-autotune" else "default"
    return (f"--compile-mode {mode} captures CUDA graphs, which fw cannot replay safely yet: its attention and MoE "
            f"operators run outside the graph on per-step metadata (block tables, KV slots, lengths) and write the "
            f"KV cache, so a replay would reuse the captured step's pages. Use --compile-mode {alternative}"
            + (" (the same autotuning without CUDA graphs)" if mode == "max-autotune" else
               " or max-autotune-no-cudagraphs") + ", or drop --compile-mode")


def check_compile_mode(mode: str | None, device_type: str) -> None:
    """Raise `UnsupportedConfigurationError` for a mode that cannot run on the device (see the module)."""
    why = cuda_graph_refusal(mode, device_type)
    if why:
        raise UnsupportedConfigurationError(why)
