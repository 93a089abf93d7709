#!/usr/bin/env bash
# On the GPU machine, from the repository root (the device tool runs it there): the GPU work order in one
# script. Each call moves the kit parts it was carried (.gpu_kit/part*, one per call: the kit is too big to
# travel in one) to $STAGE; once every file of the kit's manifest is there it installs the kit and TRL into
# $SITE and runs, within RUN_BUDGET_S seconds of its start:
#   1. scripts/bench_vs_trl.py --setting gpu86m (TRL, ours sync, async, and async with two batches in flight, on
#      SGLang) with step 4 profiled,
#   2. scripts/gpu/rollout_probe.py: the benchmark's rollout sent straight to one engine in several shapes, beside
#      transformers' generate on the same work (where the engine's time goes: router, logprobs, n, decode steps),
#      then py-spy recording the SGLang server's processes during more of the job's rollouts,
#   3. scripts/gpu_check.sh: the embedded engine, then SGLang on the tiny PPO policy, for the time left,
#   4. with VL_MODEL set (a released Qwen2.5-VL checkpoint's directory on the machine, e.g. Qwen2.5-VL-3B-Instruct):
#      two GRPO steps of it on SGLang over colour-image prompts (offline/vision.write_colour_prompts), checked as
#      tests/ppo/test_vision_job.py checks the tiny one: pushes exact, pi_old equal to the engine's logprobs,
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
STEPS=${STEPS:-bench,probe,check,vision}
VL_MODEL=${VL_MODEL:-}
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

engine=sglang
python3 -c "import sglang.srt.server_args" > /dev/null 2>&1 || { engine=embedded; say "sglang does not import: the bench runs the embedded engine"; }
if [[ $STEPS == *bench* ]]; then
  # seconds kept for the probe (an SGLang start with its CUDA graph, 7 shapes, 10 s of py-spy) and gpu_check's first cases
  reserve=$(( 20 + $([[ $STEPS == *probe* ]] && echo 100 || echo 0) + $([[ $STEPS == *check* ]] && echo 130 || echo 0) ))
  # async2: two batches generating at once (512 sequences per decode step, the CUDA graph up to that), which pays
  # where a decode step of two batches costs less than two of one (rollout_probe's two_batches says so too).
  async2="async2:trainer.mode=async;async.batches_in_flight=2;env.num_envs=512;rollout.concurrency=512"
  [ $engine = sglang ] && async2+=";rollout.sglang_args.cuda_graph_max_bs_decode=512"
  runs=(sync async "$async2")
  say "bench_vs_trl gpu86m: TRL, ours ${runs[*]%%:*}; step 4 profiled (at most $(( $(left) - reserve ))s)"
  timeout $(( $(left) - reserve )) python3 scripts/bench_vs_trl.py --setting gpu86m --engine $engine --batches 8 \
    --workdir /tmp/gpu86m --project-runs "${runs[@]}" --project-overrides 'trainer.profile_steps=[4]' > "$OUT/bench_vs_trl.log" 2>&1
  say "bench_vs_trl exit $?"
  grep -E "^(TRL|project) |median s per batch|phase split|reward, first|peak GPU|FAILED" "$OUT/bench_vs_trl.log" | cut -c1-600 | tee -a "$OUT/run.log"
  for run in sync async async2; do
    trace=$(ls /tmp/gpu86m/"$run"/profile/step_4/rank0*.json 2>/dev/null | head -n 1)
    [ -n "$trace" ] && gzip -c "$trace" > "$OUT/trace_${run}_step4.json.gz" && python3 scripts/gpu/trace_summary.py "$trace" | tee -a "$OUT/run.log"
  done
  (cd /tmp/gpu86m 2>/dev/null && tar czf "$OUT/bench_logs.tar.gz" ./*.log ./*/metrics.jsonl ./*/logs 2>/dev/null)  # with the engines' and router's logs
fi

if [[ $STEPS == *probe* ]] && [ -d /tmp/gpu86m/policy-86m ] && [ "$(left)" -gt 90 ]; then
  say "rollout_probe: the gpu86m rollout straight to one $engine engine, shape by shape (at most $(( $(left) - 15 ))s)"
  pyspy=()
  [ -x "$SITE/bin/py-spy" ] && pyspy=(--pyspy "$SITE/bin/py-spy" --pyspy-out "$OUT/pyspy_probe_engine.txt")
  timeout $(( $(left) - 15 )) python3 scripts/gpu/rollout_probe.py --workdir /tmp/gpu86m --engine $engine "${pyspy[@]}" \
    > "$OUT/rollout_probe.log" 2>&1
  say "rollout_probe exit $?"
  grep -E "^[a-z_]+ +median|decode step|engine up|py-spy" "$OUT/rollout_probe.log" | tee -a "$OUT/run.log"
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
if [[ $STEPS == *vision* ]] && [ -n "$VL_MODEL" ] && [ "$(left)" -gt 120 ]; then
  say "vision: two GRPO steps of $VL_MODEL on $engine (at most $(( $(left) - 15 ))s)"
  mkdir -p /tmp/vision && prompts=$(python3 -c "from offline.vision import write_colour_prompts as w; print(w('/tmp/vision', 448))")
  timeout $(( $(left) - 15 )) python3 -m torch.distributed.run --standalone --nproc_per_node 1 -m rl_core.train \
    --config grpo_arithmetic.yaml model.path="$VL_MODEL" data.train_path="$prompts" data.eval_path=null eval.every=0 \
    data.max_prompt_length=512 algorithm.batch_size=16 algorithm.group_size=4 algorithm.share_prompts=false \
    algorithm.old_logprobs=trainer rollout.response_length=64 rollout.engine=$engine trainer.total_episodes=32 \
    trainer.progress=false trainer.export_hf=false trainer.save_every=0 trainer.run_dir=/tmp/vision/run \
    > "$OUT/vision.log" 2>&1
  say "vision exit $?: $(python3 -c "import json; [print({k: r.get(k) for k in ('step', 'weight_sync/probe_gap', 'rollout/behaviour_logprob_gap', 'perf/step_s')}) for r in map(json.loads, open('/tmp/vision/run/metrics.jsonl'))]" 2>&1 | tr '\n' ' ')"
elif [[ $STEPS == *vision* ]]; then
  say "vision: set VL_MODEL to a Qwen2.5-VL checkpoint's directory (and leave 2 minutes) to run it"
fi
say "done; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
