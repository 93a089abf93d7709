"""Step-time benchmark of the PPO job, sync vs async, on the issue's reference setting.

A ~0.6M-parameter GPT-2 policy (2 layers, width 128) with a critic, 32 episodes per step,
8-token queries, 16-token responses, 4 PPO epochs, on this machine's CPU. Both modes run the
real job (`torchrun -m rl_core.train`) side by side in one invocation; figures are averages over
the steps after `--warmup`. Prints the step-time split (rollout / inference / update / sync),
tokens/s, episodes/s and the padding fraction; the last line is one JSON object.

    python scripts/bench_train.py [--nproc 1] [--steps 12] [--warmup 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SPLIT = ("perf/rollout_s", "perf/inference_s", "perf/train_s", "perf/sync_s", "perf/step_s")


def build_models(workdir: Path) -> tuple[Path, Path, Path]:
    """Random-init bench policy + reward model on the tiny assets' tokenizer; returns (policy, rm, prompts)."""
    sys.path.insert(0, str(REPO))
    from rl_core.assets import count_parameters, ensure_tiny_assets, init_tiny_gpt2
    from workers.models import init_reward_model, load_tokenizer

    paths = ensure_tiny_assets()
    tokenizer = load_tokenizer(str(paths.model_dir))
    policy_dir, rm_dir = workdir / "policy", workdir / "rm"
    policy = init_tiny_gpt2(tokenizer, n_layer=2, n_embd=128, n_head=4, n_positions=64)
    print(f"bench policy: {count_parameters(policy) / 1e6:.2f}M parameters, vocab {len(tokenizer)}")
    policy.save_pretrained(policy_dir)
    tokenizer.save_pretrained(policy_dir)
    init_reward_model(str(policy_dir), pad_token_id=tokenizer.pad_token_id).save_pretrained(rm_dir)
    tokenizer.save_pretrained(rm_dir)
    return policy_dir, rm_dir, paths.train_prompts


def run_mode(mode: str, args, policy: Path, rm: Path, prompts: Path, workdir: Path) -> dict:
    run_dir = workdir / mode
    episodes = 32 * (args.steps + args.warmup)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
            "-m", "rl_core.train", "--config", "ppo_sentiment.yaml",
            f"model.path={policy}", f"reward.model_path={rm}", f"data.train_path={prompts}",
            f"trainer.run_dir={run_dir}", f"trainer.total_episodes={episodes}", f"trainer.mode={mode}",
            "algorithm.batch_size=32", "algorithm.noptepochs=4", "data.query_length=8",
            "rollout.response_length=16", "reward.truncate_after=4", "trainer.progress=false",
            "trainer.export_hf=false", "trainer.log_samples_every=0"]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][args.warmup:]
    mean = {key: sum(r[key] for r in rows) / len(rows) for key in rows[0] if isinstance(rows[0][key], float)}
    return mean


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=1, help="ranks (each with its own engine)")
    parser.add_argument("--steps", type=int, default=12, help="measured steps per mode")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the averages")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
        workdir = Path(tmp)
        policy, rm, prompts = build_models(workdir)
        results = {mode: run_mode(mode, args, policy, rm, prompts, workdir) for mode in ("sync", "async")}
    print(f"\n{'':>22} {'sync':>10} {'async':>10}")
    for key in SPLIT + ("perf/episodes_per_s", "perf/tokens_per_s", "perf/padding_fraction"):
        print(f"{key:>22} {results['sync'].get(key, float('nan')):>10.3f} {results['async'].get(key, float('nan')):>10.3f}")
    print(f"async/sync steps per second: {results['sync']['perf/step_s'] / results['async']['perf/step_s']:.2f}x")
    summary = {
        "nproc": args.nproc,
        "sync_step_s": round(results["sync"]["perf/step_s"], 4),
        "async_step_s": round(results["async"]["perf/step_s"], 4),
        "episodes_per_s": round(results["sync"]["perf/episodes_per_s"], 2),
        "async_episodes_per_s": round(results["async"]["perf/episodes_per_s"], 2),
        "tokens_per_s": round(results["sync"]["perf/tokens_per_s"], 1),
        "padding_fraction": round(results["sync"]["perf/padding_fraction"], 4),
        **{f"sync_{k.split('/')[1]}": round(results["sync"][k], 4) for k in SPLIT[:-1]},
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
