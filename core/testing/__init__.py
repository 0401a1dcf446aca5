"""fw.testing: the plugin conformance kit and the helpers its suites are built from.

One line gives a plugin its conformance tests::

    from fw.testing import conformance_suite
    TestMyBackend = conformance_suite("attention_backend", "my-backend")

The suites run the plugin against plain references written in this package
(attention, linear, MoE experts) or against transformers (architectures), over
the cases the plugin's spec declares. Importing this module is cheap: torch,
transformers and the plugins load only when a suite is built or run, or a
helper below is asked for. The pytest fixtures (`fw_tiny_model`,
`fw_reference_attention`, `fw_reference_linear`) come from
`fw.testing.pytest_plugin`, registered through the `pytest11` entry point.

Every name in `__all__` is stable plugin API (docs/plugin-testing.md lists
them with their signatures; the API snapshot guards them)."""

from __future__ import annotations

import importlib

from fw.testing.suite import SUITE_KINDS, conformance_suite

# name -> the module that defines it (imported on first use: they import torch or transformers)
_LAZY = {
    "FakeSequence": "fw.testing.sequences",
    "sampler_pipeline": "fw.testing.pipeline",
    "VOCAB_SIZE": "fw.testing.models",
    "tokenizer": "fw.testing.models",
    "make_config": "fw.testing.models",
    "build_model": "fw.testing.models",
    "randomize": "fw.testing.models",
    "tiny_checkpoint": "fw.testing.models",
    "load_reference": "fw.testing.models",
    "greedy_reference": "fw.testing.models",
}

__all__ = ["SUITE_KINDS", "conformance_suite", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fw.testing' has no attribute {name!r}")
