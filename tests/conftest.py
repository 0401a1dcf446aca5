"""Shared fixtures: tiny random-weight Llama checkpoints (GQA and MHA) with an
offline BPE tokenizer, written once per session, and their transformers twins
as the numerical oracle. Nothing here touches the network."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import tiny_models  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

# The models are tiny: one thread is faster than two for their matmuls, and it keeps the suite's
# run time steady on a shared 2-core machine, where OpenMP threads spin against other processes.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def isolated_plugins(monkeypatch):
    """No FW_* variable from the caller's shell, and a fresh process-wide plugin manager."""
    from fw.plugins.manager import reset_plugin_manager

    for key in list(os.environ):
        if key.startswith("FW_"):
            monkeypatch.delenv(key)
    reset_plugin_manager()
    yield
    reset_plugin_manager()


@pytest.fixture
def root(tmp_path, monkeypatch) -> Path:
    """A directory on sys.path for fake plugin distributions (as site-packages would be)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_models.build_tokenizer()


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory, tokenizer) -> dict[str, Path]:
    """name -> checkpoint directory, for every shape in tiny_models.SPECS."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {spec.name: tiny_models.build_model(spec, tokenizer, root / spec.name) for spec in tiny_models.SPECS}


@pytest.fixture(scope="session")
def gqa_dir(model_dirs) -> Path:
    return model_dirs["gqa"]


@pytest.fixture(scope="session")
def mha_dir(model_dirs) -> Path:
    return model_dirs["mha"]


_HF: dict[Path, object] = {}


@pytest.fixture(scope="session")
def hf_model():
    """Load (once) transformers' model for a checkpoint directory."""

    def get(path: Path):
        if path not in _HF:
            _HF[path] = tiny_models.load_hf(path)
        return _HF[path]

    return get


def make_llm(path: Path, **options):
    """An engine on a tiny model, fp32 unless told, with a small explicit KV cache (the default budget is 1 GiB)."""
    from fw import LLM

    options.setdefault("num_kv_blocks", 256)
    options.setdefault("dtype", "float32")
    return LLM(model=str(path), **options)


def record_steps(llm) -> list[list[int]]:
    """Wrap the engine's model runner to record each step's new-token counts, one list per step
    (its length is the number of sequences in that forward pass)."""
    runner = llm.engine.runner
    steps: list[list[int]] = []
    original = runner.execute

    def execute(seqs, num_new):
        steps.append(list(num_new))
        return original(seqs, num_new)

    runner.execute = execute
    return steps


@pytest.fixture(scope="session")
def llm(gqa_dir):
    """A default engine on the GQA model, shared by tests that leave it idle when they finish."""
    engine = make_llm(gqa_dir)
    yield engine
    assert not engine.engine.has_unfinished_requests()


@pytest.fixture()
def fresh_llm(gqa_dir):
    """A private engine for tests that inspect step counts, statistics or KV pages."""

    def build(**options):
        return make_llm(gqa_dir, **options)

    return build
