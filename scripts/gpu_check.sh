#!/usr/bin/env bash
# GPU check: short sync and async jobs with the embedded engine and, when sglang imports, SGLang
# (tiny PPO and ~86M GRPO). Prints the step-time split and the behaviour-logprob gap; exits non-zero
# on any failure; on a machine without a CUDA GPU it says so in one line and exits 0.
#   bash scripts/gpu_check.sh [--steps 6] [--engines embedded,sglang] [--sglang-arg key=value ...]
# Python: $PYTHON, else .venv/bin/python when it exists, else python3 (e.g. with the offline kit on PYTHONPATH).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then py=$PYTHON; elif [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$py" scripts/gpu_check.py "$@"
