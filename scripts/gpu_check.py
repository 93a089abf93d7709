"""GPU check: short PPO/GRPO jobs on a CUDA machine, with the embedded engine and (when sglang imports) SGLang.

    bash scripts/gpu_check.sh [--steps 6] [--sglang-arg key=value ...]

First, packed micro-batches against padded ones on the GPU: sdpa's rows, and flash-attention's
one-row varlen layout when flash-attn imports. Then, for each engine, sync and async mode, on the tiny sentiment policy and on a ~86M-parameter
random-init GPT-2 (12 layers, width 768, the tiny tokenizer; GRPO, bf16 mixed precision), it runs
`torchrun --nproc_per_node 1 -m rl_core.train`, then prints the median step-time split
(rollout / inference / train / sync), the behaviour-logprob gap (engine vs trainer) and the
weight probe gap. Any failed run makes the exit status non-zero; the last line is one JSON object.

The offline SGLang 0.5.17 kit for H100 (pruned kernels) needs the server flags in
KIT_SGLANG_ARGS; pass `--sglang-arg key=value` to change or add any.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

KIT_SGLANG_ARGS = {"attention_backend": "triton", "sampling_backend": "pytorch",
                   "cuda_graph_backend_decode": "disabled", "cuda_graph_backend_prefill": "disabled",
                   "mm_feature_transport": "cpu", "max_total_tokens": 65536}
SPLIT = ("perf/rollout_s", "perf/inference_s", "perf/train_s", "perf/sync_s", "perf/step_s")


def build_large_policy(workdir: Path, tiny_model_dir: Path) -> Path:
    """A random-init GPT-2 of about 86M parameters on the tiny tokenizer."""
    from transformers import AutoTokenizer

    from offline.assets import count_parameters, init_tiny_gpt2

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = init_tiny_gpt2(tokenizer, n_layer=12, n_embd=768, n_head=12, n_positions=256, seed=0)
    out = workdir / "gpt2-86m"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"large policy: {count_parameters(model) / 1e6:.1f}M parameters", flush=True)
    return out


def packing_check(model_dir: Path, device: str) -> list[dict]:
    """Packed against padded token logprobs on this device, per attention kernel that loads here: sdpa
    (packed rows with a block-diagonal mask, fp32) and, when flash-attn imports, flash_attention_2 (one
    row through its varlen kernel, bf16: it has no fp32). ok: the largest gap within the dtype's tolerance."""
    import torch

    from workers.forward import token_logprobs
    from workers.layout import laid_out, rows_to_batch, packing_layout
    from workers.loading import load_causal_lm

    generator = torch.Generator().manual_seed(0)
    rows = []
    for pads, length in ((3, 40), (0, 7), (10, 90), (1, 25), (5, 60)):
        ids = torch.randint(3, 250, (length,), generator=generator).tolist()
        rows.append({"input_ids": [0] * pads + ids, "attention_mask": [0] * pads + [1] * length,
                     "action_mask": [0] * (pads + length // 2) + [1] * (length - length // 2)})
    batch = rows_to_batch(rows, pad_token_id=0)
    kernels = [("sdpa", torch.float32, 1e-4)]
    if importlib.util.find_spec("flash_attn") is not None and device == "cuda":
        kernels.append(("flash_attention_2", torch.bfloat16, 5e-2))
    results = []
    for attention, dtype, tolerance in kernels:
        layout = packing_layout(True, attention)
        model = load_causal_lm(str(model_dir), dtype, attention).to(device)
        with torch.no_grad():
            padded = token_logprobs(model, {k: v.to(device) for k, v in batch.items()})
            packed = token_logprobs(model, {k: v.to(device) for k, v in laid_out(batch, layout).items()})
        mask = batch["action_mask"].to(device).bool()
        gap = (packed - padded)[mask].abs().max().item()
        results.append({"attention": attention, "layout": layout, "max_logprob_gap": gap, "ok": gap <= tolerance})
        print(f"{'ok' if gap <= tolerance else 'FAILED'} packing/{attention}: {layout} layout against padded, "
              f"largest logprob gap {gap:.2e} (tolerance {tolerance:g}, {str(dtype).split('.')[1]})", flush=True)
    if len(kernels) == 1:
        print("packing: flash-attn does not import here; its varlen layout is not checked", flush=True)
    return results


def run_case(name: str, overrides: list[str], run_dir: Path, timeout_s: float) -> dict:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
            "-m", "rl_core.train", "--config", "ppo_sentiment.yaml", f"trainer.run_dir={run_dir}",
            "trainer.progress=false", "trainer.export_hf=false", "trainer.log_samples_every=0", *overrides]
    started = time.monotonic()
    try:
        proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
        failed = proc.returncode != 0
        tail = (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired as err:
        failed, tail = True, f"timed out after {timeout_s:.0f}s\n{(err.stdout or '')[-1500:]}"
    result = {"case": name, "ok": not failed, "wall_s": round(time.monotonic() - started, 1)}
    metrics_file = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.is_file() else []
    if failed or not rows:
        result["ok"] = False
        lines = [line.strip() for line in tail.splitlines() if line.strip() and not line.strip().startswith("=")]
        named = [line for line in lines if "error:" in line.lower() or "Error" in line]
        result["error"] = (named or lines or ["no output"])[-1]  # torchrun ends with a "====" banner
        print(f"FAILED {name}: {result['error']}\n--- last output ---\n{tail}", flush=True)
        return result
    timed = rows[1:] or rows  # the first step includes warm-up (compilation, allocator)
    for key in SPLIT:
        result[key.split("/")[1]] = round(statistics.median(r[key] for r in timed), 3)
    # Logged only on steps that recomputed old logprobs (algorithm.old_logprobs=auto skips agreeing engines).
    gaps = [r["rollout/behaviour_logprob_gap"] for r in rows if "rollout/behaviour_logprob_gap" in r]
    result["behaviour_logprob_gap"] = statistics.median(gaps) if gaps else 0.0
    result["weight_probe_gap"] = max(r["weight_sync/probe_gap"] for r in rows)
    result["score_first"], result["score_last"] = rows[0]["reward/score_mean"], rows[-1]["reward/score_mean"]
    print(f"ok {name}: step {result['step_s']}s = rollout {result['rollout_s']} + inference {result['inference_s']}"
          f" + train {result['train_s']} + sync {result['sync_s']}; behaviour gap "
          f"{result['behaviour_logprob_gap']:.2e}, probe gap {result['weight_probe_gap']:.2e}, "
          f"score {result['score_first']:.3f} -> {result['score_last']:.3f} ({result['wall_s']}s wall)", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--sglang-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="extra or changed SGLang ServerArgs (default: the offline kit's flags)")
    parser.add_argument("--engines", default="embedded,sglang")
    parser.add_argument("--models", default="tiny-ppo,86m-grpo")
    parser.add_argument("--modes", default="sync,async")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per case")
    parser.add_argument("--force-cpu", action="store_true", help="run the matrix on CPU (checks this script only)")
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available() and not args.force_cpu:
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing to check")
        return
    from offline.assets import ensure_tiny_assets
    from offline.reward_model import ensure_tiny_reward_model

    paths = ensure_tiny_assets()
    reward_model = ensure_tiny_reward_model(paths)
    packing = packing_check(paths.model_dir, "cpu" if args.force_cpu else "cuda")
    engines = [e for e in args.engines.split(",") if e]
    if "sglang" in engines and importlib.util.find_spec("sglang") is None:
        print("gpu_check: sglang does not import here; checking the embedded engine only", flush=True)
        engines.remove("sglang")
    sglang_args = dict(KIT_SGLANG_ARGS)
    for item in args.sglang_arg:
        key, _, value = item.partition("=")
        sglang_args[key] = value
    workdir = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    wanted = args.models.split(",")
    large = build_large_policy(workdir, paths.model_dir) if "86m-grpo" in wanted else None
    mixed = [] if args.force_cpu else ["model.mixed_precision=bf16"]
    models = {
        "tiny-ppo": ["algorithm.batch_size=64", f"trainer.total_episodes={64 * args.steps}"],
        "86m-grpo": [f"model.path={large}", "algorithm.advantage_estimator=grpo", "algorithm.group_size=8",
                     "algorithm.batch_size=256", f"trainer.total_episodes={256 * args.steps}", "algorithm.noptepochs=1",
                     "rollout.response_length=48", "reward.truncate_after=16", "algorithm.lr=1e-5",
                     "algorithm.packing=true", "algorithm.share_prompts=true", *mixed],  # as grpo_arithmetic
    }
    models = {name: overrides for name, overrides in models.items() if name in wanted}
    results = []
    for engine in engines:
        engine_overrides = [f"rollout.engine={engine}", f"reward.model_path={reward_model}"]
        if engine == "sglang":
            engine_overrides += [f"rollout.sglang_args.{k}={v}" for k, v in sglang_args.items()]
        for model_name, model_overrides in models.items():
            for mode in args.modes.split(","):
                name = f"{engine}/{model_name}/{mode}"
                run_dir = workdir / name.replace("/", "-")
                results.append(run_case(name, [*engine_overrides, *model_overrides, f"trainer.mode={mode}"],
                                        run_dir, args.timeout))
    failed = [r["case"] for r in results if not r["ok"]] + [f"packing/{r['attention']}" for r in packing if not r["ok"]]
    print(json.dumps({"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                      "failed": failed, "cases": results, "packing": packing}))
    if failed:
        raise SystemExit(f"gpu_check: {len(failed)} case(s) failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
