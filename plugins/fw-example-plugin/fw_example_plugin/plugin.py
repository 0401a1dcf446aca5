"""The module named in the `fw` entry point: declares the plugin API version it
targets and registers what the package provides through fw's hooks.

Importing this module stays cheap (no model code runs); torch-heavy modules are
imported here only because the specs need their classes and build functions."""

from __future__ import annotations

from fw.plugins import ArchitectureSpec, SamplerSpec, hookimpl

from fw_example_plugin.banned_tokens import BannedTokens
from fw_example_plugin.parallel_llama import build

# The fw plugin API this plugin was written against (MAJOR.MINOR). fw refuses a
# plugin for another MAJOR and warns about one for a newer MINOR.
FW_PLUGIN_API_VERSION = "1.0"


@hookimpl
def fw_register_samplers(register) -> None:
    register(SamplerSpec(
        name="banned_tokens",
        factory=BannedTokens,
        role="stage",
        order=15,  # after logit_bias (10), before penalties and temperature
        description="SamplingParams(extra_args={'banned_token_ids': [...]}) never samples those tokens",
    ))


@hookimpl
def fw_register_architectures(register) -> None:
    register(ArchitectureSpec(
        name="example-llama",
        hf_architectures=("ExampleLlamaForCausalLM",),
        build=build,
        description="Llama built from fw.layers; config.json `parallel_residual: true` switches to "
                    "parallel attention + MLP blocks (GPT-J / PaLM style)",
    ))
