"""The module fw loads: named in the `fw` entry point (installed package) and in
``--custom-architectures DIR:fw_example_arch.plugin`` (no install). It declares the plugin API
version, registers the config class with transformers (by importing `config`), and offers the
architecture both ways: the `fw_register_architectures` hook and the `ARCHITECTURES` list."""

from __future__ import annotations

from fw.plugins import ArchitectureSpec, hookimpl

from fw_example_arch.config import ARCHITECTURE
from fw_example_arch.model import build

# The fw plugin API this plugin was written against (MAJOR.MINOR).
FW_PLUGIN_API_VERSION = "1.0"

SPEC = ArchitectureSpec(
    name="parallel-lm",
    hf_architectures=(ARCHITECTURE,),
    build=build,
    description="ParallelLM: Llama with parallel attention + MLP blocks sharing one bias-free LayerNorm, "
                "QK-RMSNorm (example research plugin)",
)

# Read by --custom-architectures.
ARCHITECTURES = [SPEC]


@hookimpl
def fw_register_architectures(register) -> None:
    register(SPEC)
