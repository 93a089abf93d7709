#!/usr/bin/env bash
# On the GPU machine, from the repository root (the device tool runs it there): the GPU work order in one
# script. Each call installs the kit chunks it finds in .gpu_kit/ (carried one per call: they are too big
# to travel together) into $SITE; once SGLang and TRL import, it runs, each part time-boxed:
#   1. scripts/gpu_check.sh (embedded and SGLang, sync and async, tiny PPO and ~86M GRPO; short),
#   2. scripts/bench_vs_trl.py --setting gpu86m (TRL, ours sync and async) with step 4 profiled,
# and writes the logs, the figures (last line of each: JSON) and the profiled step's traces to $OUT.
#   bash scripts/gpu/run.sh              (OUT defaults to ./gpu_out)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}
KIT=${KIT:-$PWD/.gpu_kit}
export SITE=${SITE:-/tmp/site}
mkdir -p "$OUT"
started=$(date +%s)
say() { echo "[gpu/run.sh +$(( $(date +%s) - started ))s] $*" | tee -a "$OUT/run.log"; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1 || true
say "GPU: $(tail -n 1 "$OUT/gpu.txt")"
installer=$(ls "$KIT"/chunk*/install.sh 2>/dev/null | head -n 1)
if [ -n "$installer" ]; then
  say "installing the kit chunks present: $(cd "$KIT" && ls -d chunk* | tr '\n' ' ')"
  ALLOW_PARTIAL=1 bash "$installer" "$KIT" >> "$OUT/install.log" 2>&1
  for wheel in "$KIT"/chunk*/trl-*.whl; do
    [ -f "$wheel" ] && python3 -m pip install -q --no-index --no-deps --target "$SITE" "$wheel" >> "$OUT/install.log" 2>&1
  done
fi
export PYTHONPATH=$SITE:$PWD TVM_FFI_CACHE_DIR=/tmp/sgl_jit_cache HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  TOKENIZERS_PARALLELISM=false PYTHON=python3
if ! python3 -c "import sglang.srt.server_args, sglang_router, trl, omegaconf" >> "$OUT/install.log" 2>&1; then
  say "the kit is not complete yet (see install.log): carry the next chunk of .gpu_kit/ and run this again"
  exit 0
fi
say "kit ready; gpu_check (at most 200 s)"
timeout 200 bash scripts/gpu_check.sh --steps 4 > "$OUT/gpu_check.log" 2>&1
say "gpu_check exit $? : $(tail -n 1 "$OUT/gpu_check.log" | cut -c1-300)"
say "bench_vs_trl gpu86m, sync and async, step 4 profiled (at most 330 s)"
timeout 330 python3 scripts/bench_vs_trl.py --setting gpu86m --batches 8 --workdir /tmp/gpu86m \
  --project-overrides 'trainer.profile_steps=[4]' > "$OUT/bench_vs_trl.log" 2>&1
say "bench_vs_trl exit $?"
grep -E "median s per batch|phase split|reward, first|peak GPU" "$OUT/bench_vs_trl.log" | tee -a "$OUT/run.log"
for mode in sync async; do
  trace=$(ls /tmp/gpu86m/"$mode"/profile/step_4/rank0*.json 2>/dev/null | head -n 1)
  [ -n "$trace" ] && gzip -c "$trace" > "$OUT/trace_${mode}_step4.json.gz"
done
say "done; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
