"""An example third-party plugin for fw.

It uses only fw's public plugin API (`fw.plugins`, `fw.layers`,
`fw.sampling.batch`) and enters through the `fw` entry-point group, exactly as
any outside package would. The plugin module itself is `fw_example_plugin.plugin`.
"""

__version__ = "0.1.0"
