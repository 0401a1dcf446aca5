"""XTC ("exclude top choices") for fw, a per-request sampler plugin.

The plugin module is `fw_sampler_xtc.plugin`.
"""

__version__ = "0.1.0"
