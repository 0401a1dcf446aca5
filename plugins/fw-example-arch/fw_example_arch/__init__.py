"""ParallelLM: an example research architecture for fw, as its own package.

The plugin module named in the `fw` entry point is `fw_example_arch.plugin`;
it also serves `--custom-architectures DIR:fw_example_arch.plugin` without
installing anything.
"""

__version__ = "0.1.0"
