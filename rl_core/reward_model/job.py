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


from rl_core.checkpoint import end_if_finished
from rl_core.cli import JobEntry, run_job
from rl_core.config import save_config
from rl_core.errors import JobError
from rl_core.model_builder import Placement, build_frozen
from rl_core.distributed import DataParallel, on_every_rank, seed_everything, wait_for_rank0
from rl_core.reward_model.config import RMConfig, check_lengths, validate
from rl_core.reward_model.sampling import load_queries
from rl_core.reward_model.training import (Log, ReferenceSamples, Reporting, build_reward_model,
                                           export_reward_model, fit_reward_model)
from rl_core.preferences import load_preference_splits
from rl_core.stop_signal import StepProgress
from workers.loading import check_model_path, context_length, load_tokenizer


def resolve_inputs(cfg: RMConfig, labeler) -> dict:
    """Paths of policy, preference files and prompts, checked in one line each before anything loads."""
    def check_user_paths() -> None:
        for key, value in (("model.policy_path", cfg.model.policy_path), ("model.init_from", cfg.model.init_from)):
            if value is not None:
                check_model_path(value, key)

    on_every_rank(check_user_paths)
    output_dir = Path(cfg.trainer.output_dir or Path(cfg.trainer.run_dir) / "reward_model")
    if output_dir.is_dir() and any(output_dir.iterdir()) and not (output_dir / "config.json").is_file():
        # The export replaces the directory whole (written beside it, then renamed over it): never a user's folder.
        raise JobError(f"trainer.output_dir={output_dir} holds files but no model (no config.json), and the export "
                       "replaces the directory whole; give an empty or new directory")
    policy = cfg.model.policy_path
    return {"policy": policy, "train": cfg.data.train_path, "test": cfg.data.test_path,
            "prompts": cfg.normalize.prompts_path, "init_from": cfg.model.init_from or policy, "labeler": labeler}


def fit_and_export(cfg: RMConfig, dp: DataParallel, log: Log = print, labeler=None,
                   progress: StepProgress | None = None) -> dict:
    """The whole job on this rank; returns the metrics (identical on every rank).

    `labeler`: the rater the fresh-sample check compares with (offline runs), or None. `progress`: where the
    job is, for the line a stop signal ends with."""
    started = time.perf_counter()
    inputs = resolve_inputs(cfg, labeler)
    run_dir = Path(cfg.trainer.run_dir)
    output_dir = Path(cfg.trainer.output_dir or run_dir / "reward_model")
    tokenizer = load_tokenizer(inputs["policy"])
    seed = cfg.trainer.seed
    train, test = load_preference_splits(cfg.data, inputs["train"], inputs["test"], tokenizer, seed)
    steps = len(train) // cfg.train.batch_size
    if end_if_finished(cfg.trainer, steps, f"one epoch: {len(train)} comparisons / train.batch_size="
                       f"{cfg.train.batch_size}", "add comparisons to train on", dp.rank, export=output_dir):
        saved = run_dir / "metrics.json"  # the results it ended with, as its last line said then
        return json.loads(saved.read_text()) if saved.is_file() else {"output_dir": str(output_dir.resolve())}
    policy = build_frozen(inputs["policy"], "causal_lm", None, Placement.whole(dp.device))  # samples, unsharded
    check_lengths(cfg, context_length(policy.config))
    queries = load_queries(inputs["prompts"], cfg.normalize.text_key, tokenizer, cfg.normalize.query_length)
    model = build_reward_model(inputs["init_from"], tokenizer, seed, cfg.model)
    reference = ReferenceSamples(policy, tokenizer, queries, cfg.normalize, dp)
    metrics = fit_reward_model(model, reference, train, test, cfg, inputs["labeler"],
                               Reporting(log, progress, metrics_rows=True))
    if progress is not None:
        progress.at(None, "export")
    export_reward_model(model, tokenizer, output_dir, dp)
    metrics.update(output_dir=str(output_dir.resolve()), world_size=dp.size,
                   seconds=round(time.perf_counter() - started, 1))
    if dp.rank == 0:
        save_config(cfg, run_dir / "config.yaml")
        (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    return metrics


def main(argv: list[str] | None = None, prepare=None, get_labeler=None) -> None:
    """`prepare(cfg, log)` (the entry point's: offline assets named in the recipe) runs on every rank before
    the process group exists; `get_labeler(name)` gives the offline rater that `labeler.name` names."""
    run_job(argv, JobEntry(__doc__, "rm_sentiment.yaml", RMConfig, validate),
            lambda cfg, lifecycle, progress: train(cfg, lifecycle.data_parallel(), progress, get_labeler), prepare)


def train(cfg: RMConfig, dp: DataParallel, progress: StepProgress, get_labeler=None) -> None:
    """The job on this rank, inside the shared job lifecycle (`cli.run_job`); rank 0 ends with the
    results as one JSON line."""
    labeler = get_labeler(cfg.labeler.name) if cfg.labeler.name and get_labeler is not None else None
    seed_everything(cfg.trainer.seed)  # same init everywhere; sampling seeds are per rank (rank_seed)

    def log(line: str) -> None:
        if dp.rank == 0:
            print(line, flush=True)

    metrics = fit_and_export(cfg, dp, log, labeler, progress)
    wait_for_rank0("write the reward model")  # rank 0 alone writes it: a large model outlasts the timeout
    dp.barrier()
    if dp.rank == 0:
        print(json.dumps(metrics), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
