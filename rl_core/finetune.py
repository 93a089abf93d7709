"""What the jobs that train on fixed data (SFT, DPO) share: the optimisation section of their
config, the optimizer and schedule built from it, the rows of each step, the console line, and all of the
job after its models are built, on every job's run (`rl_core.training_run`)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from rl_core.checkpoint import end_if_finished, export_final
from rl_core.config import (LoraSettings, OptimizerConfig, TrainerConfig, choice, require,
                            validate_checkpoint_keys, validate_profile_steps)
from rl_core.distributed import DataParallel
from rl_core.model_builder import Optimization
from rl_core.optim import linear_anneal_schedule
from rl_core.stop_signal import StepProgress
from rl_core.training_run import ConsoleLine, TrainingRun
from workers.trainable import TrainableModel


@dataclass
class FinetuneTrainConfig(OptimizerConfig):
    """SFT's and DPO's training; its optimizer keys are every job's (`rl_core.config.OptimizerConfig`), whose
    defaults are these jobs': AdamW, epsilon 1e-8, gradients clipped at norm 1."""
    batch_size: int = 32  # rows (SFT) or pairs (DPO) per optimizer step, over all ranks
    epochs: int = 1  # passes over the training data
    max_steps: Optional[int] = None  # stop earlier than `epochs`
    schedule: str = choice("linear", ("linear", "constant"))  # after warmup: annealed to zero, or held
    warmup_steps: int = 0  # steps of linear warmup from zero
    max_tokens_per_device: int = 8192  # per micro-batch: its padded size, or with packing its real tokens
    # Padding-free micro-batches (workers.layout.pack): the model runs on the rows' real tokens back to
    # back, attention kept inside each row; the same losses and gradients as padded rows.
    packing: bool = False
    log_every: int = 10  # steps between metrics lines


@dataclass
class FinetuneTrainerConfig(TrainerConfig):
    save_every: int = 0  # steps between checkpoints; 0 = none
    keep_last: int = 2  # newest complete checkpoints kept on disk; 0 keeps all
    resume: str = "never"  # never | auto | <checkpoint dir>
    # A checkpoint that cannot be written (disk full, permissions): stop the job, or say so and train on.
    on_checkpoint_error: str = choice("stop", ("stop", "continue"))
    export_hf: bool = True  # <run_dir>/final in Hugging Face format
    # Steps (as logged) traced by torch.profiler into <run_dir>/profile/step_N/rankR.pt.trace.json
    # (rl_core/profiling.py); within the run's steps, which the data sets (checked once it is read).
    profile_steps: list = field(default_factory=list)

    def validate(self) -> None:
        super().validate()
        validate_checkpoint_keys(self.save_every, self.keep_last)
        validate_profile_steps(self.profile_steps, None, "")


def validate_training(tr: FinetuneTrainConfig, trainer: FinetuneTrainerConfig, lora: LoraSettings) -> None:
    lora.validate()
    trainer.validate()
    require(tr.batch_size > 0, f"config key 'train.batch_size' must be > 0, got {tr.batch_size}")
    require(tr.epochs > 0, f"config key 'train.epochs' must be > 0, got {tr.epochs}")
    require(tr.max_steps is None or tr.max_steps > 0, f"config key 'train.max_steps' must be > 0 or null, got {tr.max_steps}")
    tr.validate("train")  # the optimizer keys, as every job checks them
    require(tr.warmup_steps >= 0, f"config key 'train.warmup_steps' must be >= 0, got {tr.warmup_steps}")
    require(tr.log_every > 0, f"config key 'train.log_every' must be > 0, got {tr.log_every}")


def total_steps(tr: FinetuneTrainConfig, rows: int, what: str, source: str,
                profile_steps: Sequence[int] = ()) -> tuple[int, int]:
    """(steps per epoch, steps of the run), or one line when the data holds less than a batch or
    `profile_steps` (trainer.profile_steps) names a step beyond the run."""
    per_epoch = rows // tr.batch_size
    if per_epoch < 1:
        raise ValueError(f"{source} gives {rows} {what}, fewer than one batch (train.batch_size={tr.batch_size}); "
                         "lower train.batch_size or add data")
    steps = min(tr.max_steps or sys.maxsize, tr.epochs * per_epoch)
    if tr.schedule == "linear" and tr.warmup_steps >= steps:
        raise ValueError(f"train.warmup_steps={tr.warmup_steps} is not below the run's {steps} steps, so the "
                         "learning rate would never anneal; lower train.warmup_steps (or train.schedule=constant)")
    cap = f", train.max_steps={tr.max_steps}" if tr.max_steps else ""
    validate_profile_steps(list(profile_steps), steps, f"{rows} {what} of {source} / train.batch_size={tr.batch_size} "
                                                       f"x train.epochs={tr.epochs}{cap}")
    return per_epoch, steps


def already_finished(trainer: FinetuneTrainerConfig, tr: FinetuneTrainConfig, steps_per_epoch: int, steps: int,
                     rank: int) -> bool:
    """Whether a resumed run already ended (its checkpoint at the last step, its export written); then rank 0
    says so in one line, to be said before any model is loaded. Every rank reads the same run directory."""
    limits = f"train.epochs={tr.epochs} of {steps_per_epoch} steps" + (
        f", train.max_steps={tr.max_steps}" if tr.max_steps else "")
    return end_if_finished(trainer, steps, limits, "raise train.epochs or train.max_steps to train on", rank)


def optimization(tr: FinetuneTrainConfig, steps: int) -> Optimization:
    """The trained model's optimizer over its trainable weights (all, or the LoRA adapters) and its schedule
    (warmup, then annealed to zero or held), for `rl_core.model_builder.build_trained`."""
    if tr.schedule == "linear":
        schedule = lambda opt: linear_anneal_schedule(opt, steps, tr.warmup_steps)  # noqa: E731
    else:
        schedule = lambda opt: torch.optim.lr_scheduler.LambdaLR(  # noqa: E731
            opt, lambda step: min(1.0, (step + 1) / max(1, tr.warmup_steps)))
    return Optimization.from_config(tr, schedule)


def step_rows(rows: list, step: int, batch_size: int, seed: int) -> list:
    """The rows of global step `step`: epochs are seeded shuffles, so a resumed run sees the same batches."""
    per_epoch = len(rows) // batch_size
    epoch, offset = divmod(step, per_epoch)
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    return [rows[i] for i in order[offset * batch_size:(offset + 1) * batch_size]]


@dataclass(frozen=True)
class FixedDataSteps:
    """What a job on fixed data gives the shared step loop (rl_core/step_loop.py): `one_step(step)` trains one
    step and returns its metrics; `evaluate()` the held-out metrics (None: the job has no held-out data);
    `shown`: the metrics of the console line."""

    one_step: Callable[[int], dict]
    evaluate: Callable[[], dict] | None
    shown: tuple[str, ...]


def train(job: FixedDataSteps, name: str, trainable: TrainableModel, tokenizer, banner: str, total_steps: int,
          steps_per_epoch: int, cfg, dp: DataParallel, progress: StepProgress) -> None:
    """The rest of a fixed-data job once its models are built, on every job's run (`rl_core.training_run`):
    `trainable` checkpointed under `name`, the job's `banner` line, `epoch` in every row, an evaluation before
    training, every `eval.every` steps and at the end (when the job has one), a console line every
    `train.log_every` steps, the export."""
    run = TrainingRun(cfg, dp.rank, {name: trainable}, total_steps, ConsoleLine(job.shown, every=cfg.train.log_every))
    if dp.rank == 0:
        print(banner, flush=True)
    every = cfg.eval.every
    run.run_steps(lambda step: {**job.one_step(step), "epoch": step / steps_per_epoch}, dp.device, progress,
                  evaluate=(lambda step: job.evaluate()) if job.evaluate is not None else None,
                  eval_due=lambda step: step in (0, total_steps) or bool(every and step % every == 0))
    run.finish(lambda: export_final(cfg, trainable.model, tokenizer, dp.rank))
