#!/usr/bin/env bash
# Build .venv-sglang: the real SGLang server (pinned 0.5.23) on a CPU-only machine, beside .venv.
#
# A test and development path: CI holds the job and the embedded engine to what this server
# really does. It is slow (tens of tokens per second), never a way to train.
# SGLang's own requirements pin CUDA-only packages, so sglang goes in with --no-deps and then
# only what its CPU path imports, with torch held at the local CPU wheel. Two workarounds of
# ours (scripts/sglang_cpu/, each commented with why) make it start and a third halves its start-up;
# all are tied to 0.5.23.
# Reused when already built; rebuilt when this script or the workarounds change.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SGLANG_VENV:-.venv-sglang}
PYTHON=${PYTHON:-python3}
SGLANG_VERSION=0.5.23
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
stamp="$VENV/.rl_core-build"
want=$(cat "$0" scripts/sglang_cpu/*.py scripts/sglang_cpu/sgl_kernel/*.py | sha256sum | cut -c1-16)

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    echo "SGLang CPU environment ready (reused): $VENV"
    exit 0
fi
fail() { echo "setup_sglang_cpu: $1" >&2; exit 1; }
command -v "$PYTHON" >/dev/null || fail "no '$PYTHON' on PATH; set PYTHON=/path/to/python3.10+"

rm -rf "$VENV"
"$PYTHON" -m venv "$VENV" || fail "'$PYTHON -m venv' failed; install the venv module (Debian: apt-get install python3-venv)"
pip() { "$VENV/bin/python" -m pip -q "$@"; }
pip install --upgrade pip
pip install "torch==$TORCH_VERSION" \
    || fail "torch==$TORCH_VERSION is not installable here; set TORCH_VERSION to a CPU build pip can reach"
constraints="$VENV/constraints.txt"
echo "torch==$TORCH_VERSION" > "$constraints"
pip install --no-deps "sglang==$SGLANG_VERSION" || fail "sglang==$SGLANG_VERSION is not on the package index"
# sglang's requirements without the CUDA-only ones (kernels, flashinfer, nvidia-*, memory saver).
# pip then reports those (and torch 2.14.1) as "sglang requires ..., which is not installed": expected.
echo "installing sglang's CPU requirements (pip will list its CUDA-only ones as missing: expected)"
pip install -c "$constraints" \
    aiohttp "anthropic>=0.20.0" blobfile==3.0.0 build compressed-tensors==0.18.0 datasets distro \
    easydict einops fastapi gguf interegular IPython "llguidance>=1.7.6,<2.0.0" "mistral_common>=1.11.5" \
    modelscope msgspec ninja numpy nvidia-ml-py openai==2.8.0 openai-harmony==0.0.4 orjson \
    outlines==0.1.11 packaging partial_json_parser pillow "prometheus-client>=0.20.0" psutil pybase64 \
    pydantic "python-dateutil<3" python-multipart "pyzmq>=25.1.2" regex requests scipy \
    sentencepiece==0.2.1 setproctitle soundfile==0.13.1 tiktoken tokenizers==0.23.2 tqdm \
    transformers==5.19.0 "uvicorn>=0.51" uvloop watchfiles xgrammar==0.2.7 xxhash zstandard \
    torchvision==0.28.0 \
    || fail "could not install sglang's CPU requirements (see pip's message above)"
"$VENV/bin/python" scripts/sglang_cpu/install_workarounds.py || fail "could not apply the CPU workarounds"
"$VENV/bin/python" -c "import sglang.launch_server" 2>/dev/null \
    || fail "sglang $SGLANG_VERSION does not import on CPU: run '$VENV/bin/python -c \"import sglang.launch_server\"' to see why"
echo "$want" > "$stamp"
echo "SGLang CPU environment ready: $VENV (sglang $SGLANG_VERSION, torch $TORCH_VERSION)"
