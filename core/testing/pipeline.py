"""fw's sampler pipeline with one sampler plugin added, for that plugin's own tests."""

from __future__ import annotations

import importlib.metadata as md

from fw.plugins.manager import PluginManager
from fw.sampling.pipeline import SamplerPipeline


def sampler_pipeline(entry_point: str, module: str):
    """The `SamplerPipeline` the engine would build from fw's built-in samplers plus the plugin module
    `module`, loaded through an entry point named `entry_point` exactly as an installed plugin is (so
    a plugin's tests run from its checkout, installed or not)."""
    eps = [ep for ep in md.distribution("fw").entry_points if ep.group == "fw" and ep.name == "samplers"]
    eps.append(md.EntryPoint(name=entry_point, value=module, group="fw"))
    manager = PluginManager(entry_points=eps, allow={"samplers", entry_point}, block=(), strict=True).load()
    return SamplerPipeline(manager.registry("sampler"), "default")
