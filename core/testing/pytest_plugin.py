"""fw's pytest plugin (entry point `pytest11`: fw = "fw.testing.pytest_plugin").

Fixtures for plugin authors' tests; nothing here runs unless a test asks for a fixture, and
importing this module imports neither torch nor transformers (pytest loads it in every run):

- `fw_tiny_model`: a factory, ``fw_tiny_model("LlamaForCausalLM")`` (or a built-in fw
  architecture name, or ``hf_config=<transformers config>``) -> the directory of a tiny
  random-weight checkpoint with the kit's offline tokenizer; one per architecture per session.
- `fw_reference_attention`: `fw.testing.attention.reference_attention`, plain causal attention
  in fp32 with Hugging Face's sliding window and soft-cap.
- `fw_reference_linear`: `fw.testing.quantization.reference_linear`, x @ W^T + b in float64."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def fw_tiny_model(tmp_path_factory):
    made: dict[str, object] = {}

    def make(architecture: str | None = None, hf_config=None):
        from fw.testing import models  # here: pytest loads this plugin in every run; torch with the fixture

        if hf_config is not None:
            return models.tiny_checkpoint(None, tmp_path_factory.mktemp("fw_tiny_model"), hf_config=hf_config)
        name = models.hf_architecture(architecture)
        if name not in made:
            made[name] = models.tiny_checkpoint(name, tmp_path_factory.mktemp(f"fw_tiny_{name}"))
        return made[name]

    return make


@pytest.fixture(scope="session")
def fw_reference_attention():
    from fw.testing.attention import reference_attention  # here: as in fw_tiny_model

    return reference_attention


@pytest.fixture(scope="session")
def fw_reference_linear():
    from fw.testing.quantization import reference_linear  # here: as in fw_tiny_model

    return reference_linear
