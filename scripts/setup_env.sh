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
echo "environment ready: $(.venv/bin/python -c 'import torch; print("torch", torch.__version__)')"
