"""Reward-model training job: learn a scalar reward from preference comparisons.

    torchrun --nproc_per_node 2 -m rl_core.train_rm --config rm_sentiment.yaml [key=value ...]
    python -m rl_core.train_rm --config rm_sentiment.yaml          # a world of one

Follows Ziegler et al. (2019) / lm-human-preferences: the reward is the score head's output at
the last token of query+response; before and after training the reward is affinely normalised
(gain, bias) so that responses sampled from the reference policy score mean 0 and std 1; one
epoch with the learning rate annealed linearly to zero, because labels are scarce and a second
pass overfits them. Training runs on the same FSDP2 worker as PPO, over token-balanced
micro-batches with the global loss-scaling rule. The checkpoint is a Hugging Face
sequence-classification model (num_labels=1) with ``reward_gain``/``reward_bias`` in its config.

The last line printed is one JSON object with the results (held-out accuracy, Spearman
correlation with the labeler on fresh samples, gain, bias, normalised mean/std, output_dir).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch.distributed as dist

from rl_core.cli import parse_job_config, run_main
from rl_core.config import save_config
from rl_core.distributed import device_for_rank, init_distributed, on_every_rank, on_rank0, seed_everything
from rl_core.reward_model.config import RMConfig, check_lengths, validate
from rl_core.reward_model.sampling import load_queries
from rl_core.reward_model.training import (DataParallel, Log, build_reward_model, export_reward_model,
                                           fit_reward_model, load_preference_splits)
from rl_core.run_dir import RunDirLock
from workers.models import check_model_path, context_length, load_causal_lm, load_tokenizer


def resolve_inputs(cfg: RMConfig, dp: DataParallel, log: Log) -> dict:
    """Paths of policy, preference files and prompts ("tiny" ones are built, rank 0 first), and the
    offline labeler named by labeler.name (the rater the fresh-sample check compares with).

    Model paths the user gave are checked first, in one line each, before anything is built or loaded.
    """
    def check_user_paths() -> None:
        for key, value in (("model.policy_path", cfg.model.policy_path), ("model.init_from", cfg.model.init_from)):
            if value not in (None, "tiny"):
                check_model_path(value, key)

    on_every_rank(check_user_paths)
    labeler = None
    if cfg.labeler.name:
        from rl_core.tiny.labeler import get_labeler

        labeler = get_labeler(cfg.labeler.name)
    paths = None
    if "tiny" in (cfg.model.policy_path, cfg.data.train_path, cfg.normalize.prompts_path):
        from rl_core.tiny.assets import ensure_tiny_assets
        from rl_core.tiny.reward_model import ensure_tiny_preferences, preference_files

        def build(log_to: Log, progress: bool):
            built = ensure_tiny_assets(log=log_to, progress=progress)
            if cfg.data.train_path == "tiny":
                ensure_tiny_preferences(built, cfg.labeler.name, log_to, noise=cfg.labeler.noise, progress=progress)
            return built

        if dp.rank == 0:  # rank 0 builds what is missing (and logs, with progress bars) while the others wait
            paths = build(log, cfg.trainer.progress)
        dp.barrier()
        if dp.rank != 0:
            paths = build(lambda *_: None, False)
    policy = str(paths.model_dir) if cfg.model.policy_path == "tiny" else cfg.model.policy_path
    train, test = cfg.data.train_path, cfg.data.test_path
    if train == "tiny":
        tiny_train, tiny_test, _ = preference_files(paths, cfg.labeler.name)
        train, test = str(tiny_train), (str(tiny_test) if test == "tiny" else test)
    prompts = str(paths.train_prompts) if cfg.normalize.prompts_path == "tiny" else cfg.normalize.prompts_path
    return {"policy": policy, "train": train, "test": test, "prompts": prompts,
            "init_from": cfg.model.init_from or policy, "labeler": labeler}


def run_job(cfg: RMConfig, dp: DataParallel, log: Log = print) -> dict:
    """The whole job on this rank; returns the metrics (identical on every rank)."""
    started = time.perf_counter()
    inputs = resolve_inputs(cfg, dp, log)
    tokenizer = load_tokenizer(inputs["policy"])
    policy = load_causal_lm(inputs["policy"]).to(dp.device).eval()
    check_lengths(cfg, context_length(policy.config))
    seed = cfg.trainer.seed
    train, test = load_preference_splits(cfg.data, inputs["train"], inputs["test"], tokenizer, seed)
    queries = load_queries(inputs["prompts"], cfg.normalize.text_key, tokenizer, cfg.normalize.query_length)
    model = build_reward_model(inputs["init_from"], tokenizer, seed)
    metrics = fit_reward_model(model, policy, tokenizer, train, test, queries, cfg, dp, inputs["labeler"], log)
    run_dir = Path(cfg.trainer.run_dir)
    output_dir = Path(cfg.trainer.output_dir or run_dir / "reward_model")
    export_reward_model(model, tokenizer, output_dir, dp)
    metrics.update(output_dir=str(output_dir.resolve()), world_size=dp.size,
                   seconds=round(time.perf_counter() - started, 1))
    if dp.rank == 0:
        save_config(cfg, run_dir / "config.yaml")
        (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    return metrics


def main(argv: list[str] | None = None) -> None:
    run_main(_main, argv)


def _main(argv: list[str] | None) -> None:
    cfg = parse_job_config(argv, __doc__, "rm_sentiment.yaml", RMConfig, validate)
    rank, world_size = init_distributed(timeout_s=cfg.trainer.collective_timeout_s)
    lock = None
    try:
        # One live job per run directory; every rank stops at once if another job holds it.
        lock = on_rank0(lambda: RunDirLock(cfg.trainer.run_dir).acquire())
        seed_everything(cfg.trainer.seed)  # same init everywhere; sampling seeds are per rank (rank_seed)
        dp = DataParallel(rank, world_size, sharded=True, device=device_for_rank())

        def log(line: str) -> None:
            if rank == 0:
                print(line, flush=True)

        metrics = run_job(cfg, dp, log)
        dp.barrier()
        if rank == 0:
            print(json.dumps(metrics), flush=True)
    finally:
        dist.destroy_process_group()
        if lock is not None:
            lock.release()


if __name__ == "__main__":
    main(sys.argv[1:])
