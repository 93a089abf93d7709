"""Supervised fine-tuning: `torchrun --nproc_per_node N -m rl_core.train_sft --config sft_arithmetic.yaml [key=value ...]`.

Chat (`messages`) or prompt/response rows, the loss on the assistant (response) tokens only, a
mean over every trained token of the step. Same worker as the RL jobs (FSDP2, token-balanced
micro-batches), same config machinery, checkpoints (`trainer.save_every`, `trainer.resume=auto`),
metrics (`metrics.jsonl`, TensorBoard, wandb) and Hugging Face export (`<run_dir>/final`).
Evaluation (step 0, every `eval.every` steps, the end): held-out loss and token accuracy, and with
`eval.reward_fn` the accuracy of greedy completions.
"""

from __future__ import annotations

import sys


from rl_core.distributed import DataParallel, on_every_rank, seed_everything
from rl_core import finetune
from rl_core.cli import JobEntry, run_job
from rl_core.model_builder import Placement, build_trained
from rl_core.rewards import load_reward_fn
from rl_core.sft.config import SFTConfig, validate
from rl_core.sft.data import encode_rows, load_rows
from rl_core.sft.training import generation_accuracy, heldout_metrics, train_step
from rl_core.stop_signal import StepProgress
from workers import loading
from workers.worker import BatchWorker


def main(argv: list[str] | None = None, prepare=None) -> None:
    """`prepare(cfg, log)`: the entry point's offline assets, resolved before any process group exists."""
    run_job(argv, JobEntry(__doc__, "sft_arithmetic.yaml", SFTConfig, validate),
            lambda cfg, lifecycle, progress: train(cfg, lifecycle.data_parallel(), progress), prepare)


def train(cfg: SFTConfig, dp: DataParallel, progress: StepProgress | None = None) -> None:
    """The job on `dp`: every rank of the process group (sharded), or this process alone
    (`DataParallel()`, no torch.distributed call: how the arithmetic recipe's policy is built).
    `progress`: where it is, for the line a stop signal ends with (`run_main`'s)."""
    progress = progress or StepProgress(dp.rank)
    tr = cfg.train
    reward_fn = load_reward_fn(cfg.eval.reward_fn) if cfg.eval.reward_fn else None
    if dp.sharded:
        on_every_rank(lambda: loading.check_model_path(cfg.model.path, "model.path"))
    else:  # alone, maybe inside another job's process group: no collective
        loading.check_model_path(cfg.model.path, "model.path")
    tokenizer = loading.load_tokenizer(cfg.model.tokenizer_path or cfg.model.path)
    train_rows, eval_rows = load_data(cfg, tokenizer, dp.rank)
    steps_per_epoch, total_steps = finetune.total_steps(tr, len(train_rows), "usable rows", cfg.data.train_path,
                                                      cfg.trainer.profile_steps)
    if finetune.already_finished(cfg.trainer, tr, steps_per_epoch, total_steps, dp.rank):  # before loading the model
        return
    seed_everything(cfg.trainer.seed)  # the same initial weights on every rank
    placement = Placement() if dp.sharded else Placement.whole(dp.device)
    # One embedding row per tokenizer id: a [PAD] the tokenizer gained is fed to the model as input.
    trainable = build_trained(cfg.model.path, "causal_lm", cfg.model, placement,
                              finetune.optimization(tr, total_steps), vocab_size=len(tokenizer))
    model = trainable.model
    worker = BatchWorker.for_job(cfg.model, dp.rank, dp.size, dp.device, tr.max_tokens_per_device, tr.packing)

    def evaluate() -> dict[str, float]:
        metrics = heldout_metrics(model, worker, eval_rows, tokenizer.pad_token_id)
        if reward_fn is not None:
            metrics.update(generation_accuracy(model, eval_rows[:cfg.eval.generate_rows], reward_fn, tokenizer, dp,
                                               cfg.eval.max_new_tokens))
        return metrics

    steps = finetune.FixedDataSteps(
        one_step=lambda step: train_step(trainable, worker, finetune.step_rows(train_rows, step, tr.batch_size,
                                                                               cfg.trainer.seed), tokenizer.pad_token_id),
        evaluate=evaluate if eval_rows else None, shown=SHOWN)
    banner = f"[sft] {len(train_rows)} rows, {total_steps} steps of {tr.batch_size} on {dp.size} rank(s)"
    finetune.train(steps, "model", trainable, tokenizer, banner, total_steps, steps_per_epoch, cfg, dp, progress)


def load_data(cfg: SFTConfig, tokenizer, rank: int):
    """Every rank tokenizes the rows (each step needs the whole batch's lengths); rank 0 reports."""
    train_rows, too_long = encode_rows(load_rows(cfg.data.train_path, "data.train_path"), tokenizer, cfg.data,
                                       cfg.data.train_path)
    eval_rows = []
    if cfg.data.eval_path is not None:
        eval_rows, _ = encode_rows(load_rows(cfg.data.eval_path, "data.eval_path"), tokenizer, cfg.data,
                                   cfg.data.eval_path)
        eval_rows = eval_rows[:cfg.data.eval_max_rows]
    if rank == 0 and too_long:
        print(f"[sft] {too_long} rows longer than data.max_length={cfg.data.max_length} were "
              f"{'left out' if cfg.data.on_long == 'drop' else 'cut'}", flush=True)
    return train_rows, eval_rows


SHOWN = ("train/loss", "train/token_accuracy", "eval/loss", "eval/token_accuracy", "eval/accuracy", "perf/step_s")


if __name__ == "__main__":
    main(sys.argv[1:])
