#!/usr/bin/env bash
# Create .venv and install the project on a fresh CPU machine.
# torch is installed first, pinned to the local CPU wheel, so nothing pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install -q -e ".[dev]"
# The oldest transformers that setup.cfg admits (5.12.1, SGLang 0.5.17's pin), beside .venv for
# tests/workers/test_transformers_floor.py, which runs the embedded engine's tests on it.
.venv/bin/python -m pip install -q --no-deps --upgrade --target .venv-floor \
    transformers==5.12.1 tokenizers==0.22.2 huggingface-hub==1.33.0
echo "environment ready: $(.venv/bin/python -c 'import torch; print("torch", torch.__version__)')"
