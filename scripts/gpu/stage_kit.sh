#!/usr/bin/env bash
# On a machine with the package index: put the offline SGLang 0.5.17 kit (three chunks, each under 44 MiB)
# and the TRL 1.16.0 wheel into .gpu_kit/ (git-ignored), ready to be carried to the GPU machine one chunk
# per call (scripts/gpu/README.md). The kit's own fetch.sh does the fetching and install.sh checks sha256.
#   bash scripts/gpu/stage_kit.sh [SHARED_GPU_DIR]     (default: ../shared/gpu beside the checkout)
set -euo pipefail
cd "$(dirname "$0")/../.."
shared=${1:-../shared/gpu}
[ -f "$shared/sglang-0.5.17-h100/fetch.sh" ] || { echo "stage_kit.sh: no kit at $shared/sglang-0.5.17-h100; pass the folder that holds it"; exit 2; }
bash "$shared/sglang-0.5.17-h100/fetch.sh" .gpu_kit
cp "$shared"/trl/trl-*.whl .gpu_kit/chunk3/
du -sh .gpu_kit/chunk*
