#!/usr/bin/env bash
# On the GPU machine, from the repository root (the device tool runs it there): the GPU work order in one
# script. Each call moves the kit parts it was carried (.gpu_kit/part*, one per call: the kit is too big to
# travel in one) to $STAGE; once every file of the kit's manifest is there it installs the kit and TRL into
# $SITE and runs, within RUN_BUDGET_S seconds of its start:
#   1. scripts/bench_vs_trl.py --setting gpu86m (TRL, ours sync and async on SGLang) with step 4 profiled, and
#      ours sync once more with py-spy recording the SGLang server and the trainer (where the rollout's time goes),
#   2. scripts/gpu/rollout_probe.py: the benchmark's rollout sent straight to one engine in several shapes, beside
#      transformers' generate on the same work (where the engine's time goes: router, logprobs, n, decode steps),
#   3. scripts/gpu_check.sh: the embedded engine, then SGLang on the tiny PPO policy, for the time left,
# and writes the logs, the figures (last line of each: JSON) and the profiled step's traces to $OUT.
#   bash scripts/gpu/run.sh              (OUT defaults to ./gpu_out)
#   STEPS=check bash scripts/gpu/run.sh  (a warm machine, kit installed: gpu_check only; STEPS lists what runs:
#                                         bench, probe, check)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}
KIT=${KIT:-$PWD/.gpu_kit}
STAGE=${STAGE:-/tmp/stage}
RUN_BUDGET_S=${RUN_BUDGET_S:-540}
STEPS=${STEPS:-bench,probe,check}
export SITE=${SITE:-/tmp/site}
mkdir -p "$OUT" "$STAGE"
started=$(date +%s)
left() { echo $(( RUN_BUDGET_S - ($(date +%s) - started) )); }
say() { echo "[gpu/run.sh +$(( $(date +%s) - started ))s] $*" | tee -a "$OUT/run.log"; }

say "GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -n 1)"
for part in "$KIT"/part*; do
  [ -d "$part" ] && mv -f "$part"/* "$STAGE"/ && rmdir "$part" && say "staged $(basename "$part")"
done
if ! PYTHONPATH=$SITE python3 -c "import sglang.srt.server_args, sglang_router, trl, omegaconf" > /dev/null 2>&1; then
  installer=$(ls "$STAGE"/install.sh 2>/dev/null)
  [ -n "$installer" ] || { say "nothing staged yet: carry .gpu_kit/part1"; exit 0; }
  bash "$installer" "$STAGE" > "$OUT/install.log" 2>&1
  status=$?
  missing=$(grep -c '^MISSING' "$OUT/install.log")
  if [ "$missing" -gt 0 ]; then
    say "kit not complete ($missing files missing): carry the next part of .gpu_kit/ and run this again"
    exit 0
  fi
  [ $status -eq 0 ] || say "the kit's install failed (exit $status; install.log): what does not need SGLang still runs"
  for wheel in "$STAGE"/trl-*.whl "$STAGE"/py_spy-*.whl; do
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$wheel" >> "$OUT/install.log" 2>&1
  done
  say "kit installed: $(grep -E 'SMOKE|sglang ' "$OUT/install.log" | tr '\n' ' ')"
fi
export PYTHONPATH=$SITE:$PWD TVM_FFI_CACHE_DIR=/tmp/sgl_jit_cache HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  TOKENIZERS_PARALLELISM=false PYTHON=python3 PYTHONUNBUFFERED=1

# profile_rollout RUN: once RUN's second step is logged, py-spy records its SGLang server (with the scheduler and
# detokenizer under it) and its trainer for 10 s; raw stacks (one line per stack and count) go to $OUT.
profile_rollout() {
  local metrics=/tmp/gpu86m/$1/metrics.jsonl server trainer
  for _ in $(seq 1200); do [ -f "$metrics" ] && [ "$(wc -l < "$metrics")" -ge 2 ] && break; sleep 0.5; done
  server=$(pgrep -n -f "sglang.launch_server")
  trainer=$(pgrep -o -f -- "-u -m rl_core.train")  # the rank, not its reward pool's workers (forked later)
  [ -n "$server" ] && "$SITE/bin/py-spy" record -s --nonblocking -r 100 -d 10 --format raw -o "$OUT/pyspy_$1_sglang.txt" -p "$server" \
    > "$OUT/pyspy_$1.log" 2>&1 &
  [ -n "$trainer" ] && "$SITE/bin/py-spy" record --nonblocking -r 100 -d 10 --format raw -o "$OUT/pyspy_$1_trainer.txt" -p "$trainer" \
    >> "$OUT/pyspy_$1.log" 2>&1
  wait
}

engine=sglang
python3 -c "import sglang.srt.server_args" > /dev/null 2>&1 || { engine=embedded; say "sglang does not import: the bench runs the embedded engine"; }
if [[ $STEPS == *bench* ]]; then
  # seconds kept for the probe (an SGLang start with its CUDA graph, 7 shapes) and gpu_check's first cases
  reserve=$(( 20 + $([[ $STEPS == *probe* ]] && echo 100 || echo 0) + $([[ $STEPS == *check* ]] && echo 130 || echo 0) ))
  runs=(sync async)
  # Once more in sync mode with py-spy recording the SGLang server's processes and the trainer for 10 s from step 3
  # on (py-spy slows what it samples: this run's timings are not the figure, its stacks say where the rollout goes).
  if [ $engine = sglang ] && [ -x "$SITE/bin/py-spy" ]; then
    runs+=("sync_pyspy:trainer.mode=sync")
    profile_rollout sync_pyspy &
  fi
  say "bench_vs_trl gpu86m: TRL, ours ${runs[*]%%:*}; step 4 profiled (at most $(( $(left) - reserve ))s)"
  timeout $(( $(left) - reserve )) python3 scripts/bench_vs_trl.py --setting gpu86m --engine $engine --batches 8 \
    --workdir /tmp/gpu86m --project-runs "${runs[@]}" --project-overrides 'trainer.profile_steps=[4]' > "$OUT/bench_vs_trl.log" 2>&1
  say "bench_vs_trl exit $?"
  wait  # the profiler
  grep -E "^(TRL|project) |median s per batch|phase split|reward, first|peak GPU|FAILED" "$OUT/bench_vs_trl.log" | cut -c1-600 | tee -a "$OUT/run.log"
  for run in sync async sync_pyspy; do
    trace=$(ls /tmp/gpu86m/"$run"/profile/step_4/rank0*.json 2>/dev/null | head -n 1)
    [ -n "$trace" ] && gzip -c "$trace" > "$OUT/trace_${run}_step4.json.gz" && python3 scripts/gpu/trace_summary.py "$trace" | tee -a "$OUT/run.log"
  done
  (cd /tmp/gpu86m 2>/dev/null && tar czf "$OUT/bench_logs.tar.gz" ./*.log ./*/metrics.jsonl ./*/logs 2>/dev/null)  # with the engines' and router's logs
fi

if [[ $STEPS == *probe* ]] && [ -d /tmp/gpu86m/policy-86m ] && [ "$(left)" -gt 90 ]; then
  say "rollout_probe: the gpu86m rollout straight to one $engine engine, shape by shape (at most $(( $(left) - 15 ))s)"
  timeout $(( $(left) - 15 )) python3 scripts/gpu/rollout_probe.py --workdir /tmp/gpu86m --engine $engine \
    > "$OUT/rollout_probe.log" 2>&1
  say "rollout_probe exit $?"
  grep -E "^[a-z_]+ +median|decode step|engine up" "$OUT/rollout_probe.log" | tee -a "$OUT/run.log"
elif [[ $STEPS == *probe* ]]; then
  say "rollout_probe: no bench assets in /tmp/gpu86m or no time left; run again with STEPS=probe"
fi

if [[ $STEPS == *check* ]] && [ "$(left)" -gt 75 ]; then
  # The embedded engine first: SGLang's tiny PPO cases passed on the H200 (2026-11-27), the embedded ones did not run.
  say "gpu_check: the embedded engine, then SGLang tiny PPO (at most $(( $(left) - 15 ))s)"
  timeout $(( $(left) - 15 )) bash -c 'bash scripts/gpu_check.sh --steps 4 --engines embedded;
    bash scripts/gpu_check.sh --steps 4 --engines sglang --models tiny-ppo' > "$OUT/gpu_check.log" 2>&1
  say "gpu_check exit $?: $(grep -E '^(ok|FAILED)' "$OUT/gpu_check.log" | cut -c1-160 | tr '\n' '|')"
elif [[ $STEPS == *check* ]]; then
  say "gpu_check: no time left in RUN_BUDGET_S; run again with STEPS=check"
fi
say "done; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
