"""fw.testing: the plugin conformance kit.

One line gives a plugin its conformance tests::

    from fw.testing import conformance_suite
    TestMyBackend = conformance_suite("attention_backend", "my-backend")

The suites run the plugin against plain references written in this package
(attention, linear, MoE experts) or against transformers (architectures), over
the cases the plugin's spec declares. Importing this module is cheap: torch,
transformers and the plugins load only when a suite is built or run. The pytest
fixtures (`fw_tiny_model`, `fw_reference_attention`, `fw_reference_linear`)
come from `fw.testing.pytest_plugin`, registered through the `pytest11` entry
point. See docs/plugin-testing.md."""

from __future__ import annotations

from fw.testing.suite import SUITE_KINDS, conformance_suite

__all__ = ["SUITE_KINDS", "conformance_suite", "FakeSequence", "sampler_pipeline"]


def __getattr__(name: str):
    if name == "FakeSequence":  # imports torch: only when asked for
        from fw.testing.sequences import FakeSequence

        return FakeSequence
    if name == "sampler_pipeline":
        from fw.testing.pipeline import sampler_pipeline

        return sampler_pipeline
    raise AttributeError(name)
