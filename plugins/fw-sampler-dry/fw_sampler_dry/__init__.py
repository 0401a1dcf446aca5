"""DRY ("Don't Repeat Yourself") repetition suppression for fw, a per-request sampler plugin.

The plugin module is `fw_sampler_dry.plugin`; the matching itself is `fw_sampler_dry.matching`.
"""

__version__ = "0.1.0"
