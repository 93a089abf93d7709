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
    from rl_core.tiny.assets import count_parameters, ensure_tiny_assets, init_tiny_gpt2
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
            "algorithm.batch_size=32", "algorithm.noptepochs=4", "data.max_prompt_length=8",
            "rollout.response_length=16", "reward.truncate_after=4", "trainer.progress=false",
            "trainer.export_hf=false", "trainer.log_samples_every=0"]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][args.warmup:]
    mean = {key: sum(r[key] for r in rows) / len(rows) for key in rows[0] if isinstance(rows[0][key], float)}
    return mean


def update_floor_s(policy_dir: Path, epochs: int = 4, episodes: int = 32, tokens: int = 24, repeats: int = 5) -> float:
    """Seconds of the bare PPO update on this machine: ``epochs`` x (actor + critic) forward,
    backward and Adam step on one [episodes, tokens] batch, plain PyTorch modules, no framework.

    No implementation of this benchmark's update can beat it on these cores, so it bounds
    episodes/s from above even with rollout, inference and weight sync for free.
    """
    import time

    import torch

    from workers.models import ValueModel, load_causal_lm

    actor, critic = load_causal_lm(str(policy_dir)), ValueModel.from_pretrained(str(policy_dir))
    optimizers = [torch.optim.Adam(m.parameters(), lr=1e-5, foreach=True) for m in (actor, critic)]
    ids = torch.randint(0, actor.config.vocab_size, (episodes, tokens))
    mask, positions = torch.ones_like(ids), torch.arange(tokens).expand(episodes, tokens)

    def one_update() -> None:
        for _ in range(epochs):
            logits = actor(input_ids=ids, attention_mask=mask, position_ids=positions).logits
            values = critic(ids, mask, positions)
            for loss, optimizer in ((torch.log_softmax(logits, -1).mean(), optimizers[0]),
                                    (values.square().mean(), optimizers[1])):
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

    one_update()  # warm-up
    started = time.perf_counter()
    for _ in range(repeats):
        one_update()
    return (time.perf_counter() - started) / repeats


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
        floor_s = update_floor_s(policy)
    print(f"\n{'':>22} {'sync':>10} {'async':>10}")
    for key in SPLIT + ("perf/episodes_per_s", "perf/tokens_per_s", "perf/padding_fraction"):
        print(f"{key:>22} {results['sync'].get(key, float('nan')):>10.3f} {results['async'].get(key, float('nan')):>10.3f}")
    print(f"async/sync steps per second: {results['sync']['perf/step_s'] / results['async']['perf/step_s']:.2f}x")
    print(f"bare update floor (plain PyTorch, same shapes, this machine): {floor_s:.3f} s per step, at most "
          f"{32 / floor_s:.0f} episodes/s with rollout, inference and sync for free; the job's update takes "
          f"{results['sync']['perf/train_s'] / floor_s:.2f}x the floor")
    summary = {
        "nproc": args.nproc,
        "sync_step_s": round(results["sync"]["perf/step_s"], 4),
        "async_step_s": round(results["async"]["perf/step_s"], 4),
        "episodes_per_s": round(results["sync"]["perf/episodes_per_s"], 2),
        "async_episodes_per_s": round(results["async"]["perf/episodes_per_s"], 2),
        "tokens_per_s": round(results["sync"]["perf/tokens_per_s"], 1),
        "padding_fraction": round(results["sync"]["perf/padding_fraction"], 4),
        "update_floor_s": round(floor_s, 4),
        "floor_episodes_per_s": round(32 / floor_s, 1),
        **{f"sync_{k.split('/')[1]}": round(results["sync"][k], 4) for k in SPLIT[:-1]},
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
