"""The plugin installed the way a user installs it (`pip install ./plugins/fw-example-arch`, here
into a target directory from a copy of the source, offline): `fw plugins list` shows it, and
`fw generate` runs a ParallelLM checkpoint with nothing else configured."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from parallel_lm_reference import PLUGIN_ROOT, build_tokenizer, random_reference, tiny_config, write_checkpoint


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("example_arch_install")
    src, target = base / "src", base / "site"
    shutil.copytree(PLUGIN_ROOT, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "tests"))
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "--target", str(target), str(src)],
        check=True, capture_output=True, text=True, timeout=120,
    )
    return target


def run_fw(site: Path, *args: str) -> subprocess.CompletedProcess:
    """The `fw` command in a fresh process that sees the installed plugin (and no FW_* settings)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FW_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH", "")) if p)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", FW_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "fw.cli.main", *args], env=env, capture_output=True, text=True,
                          timeout=120, cwd=site)


def test_installed_plugin_is_listed_and_generates(site, tmp_path):
    listing = run_fw(site, "plugins", "list", "--json")
    assert listing.returncode == 0, listing.stderr
    row = {r["name"]: r for r in json.loads(listing.stdout)["plugins"]}["example_arch"]
    assert row["distribution"] == "fw-example-arch" and row["version"] == "0.1.0"
    assert row["status"] == "loaded" and row["api_version"] == "1.0"
    assert row["provides"] == {"architecture": ["parallel-lm"]}

    tokenizer = build_tokenizer()
    checkpoint = write_checkpoint(tmp_path / "ckpt", random_reference(tiny_config(tokenizer)), tokenizer)
    run = run_fw(site, "generate", "--model", str(checkpoint), "--prompt", "the quick brown fox",
                 "--max-tokens", "6", "--temperature", "0", "--ignore-eos", "--dtype", "float32",
                 "--num-kv-blocks", "16")
    assert run.returncode == 0, run.stderr
    ids = tokenizer("the quick brown fox").input_ids
    expected, _ = random_reference(tiny_config(tokenizer)).greedy(ids, 6)
    assert run.stdout.strip() == tokenizer.decode(expected).strip()
