"""What every training job (PPO, SFT, DPO, the reward model) does around its own steps, written once: the resume
from `trainer.resume` (the job's trained models and its own checkpoint state), rank 0's metrics logger and console
line, the step loop every job shares (`rl_core/step_loop.py`) with the evaluation before training and the
checkpoints, and the end (the export, the logger closed). A job keeps what is its own: its models, data, step and
evaluation, and what its checkpoints hold besides the models.

    run = TrainingRun(cfg, rank, {"policy": trainable}, total_steps, ConsoleLine(SHOWN, every=10))
    run.run_steps(one_step, device, progress, evaluate=evaluate, eval_due=due)
    run.finish(lambda: export_final(cfg, trainable.model, tokenizer, rank))
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from rl_core.checkpoint import Checkpointer
from rl_core.logger import open_run_logger, step_line
from rl_core.step_loop import StepHooks, run_steps
from rl_core.stop_signal import StepProgress


@dataclass(frozen=True)
class ConsoleLine:
    """Rank 0's console line of a step (`rl_core.logger.step_line`): the `shown` metrics after `prefix`, at step 0,
    every `every` steps, the last step and every evaluation, said through `say`."""
    shown: tuple[str, ...]
    every: int = 1
    prefix: str = ""
    say: Callable[[str], None] = functools.partial(print, flush=True)


class TrainingRun:
    """One job's run on this rank. `trained`: the models its checkpoints hold, by name (`TrainableModel`s,
    restored in place on a resume); `state()`: what else they hold (this rank's; None: nothing), read back in
    `saved`; `rows`: whether rank 0 writes metrics rows (metrics.jsonl, TensorBoard) into the run directory."""

    def __init__(self, cfg, rank: int, trained: dict, total_steps: int, line: ConsoleLine,
                 state: Callable[[], dict | None] = lambda: None, rows: bool = True):
        self.trainer, self.rank, self.trained, self.total_steps, self.line = cfg.trainer, rank, trained, total_steps, line
        self.state = state
        self.checkpointer = Checkpointer.for_run(cfg.trainer, rank)
        # A fresh run starts at 0 with nothing saved; a resumed one after its checkpoint's step, with its state.
        self.start_step, self.saved = self.checkpointer.maybe_resume(cfg.trainer.resume, trained)
        # Rows after the checkpoint's step (an interrupted run's) are dropped: each step is logged once.
        self.logger = open_run_logger(cfg, self.start_step) if rank == 0 and rows else None

    def log(self, step: int, metrics: dict, line: bool | None = None) -> None:
        """Rank 0: the step's metrics row, and its console line when `line` (None: when the line is due)."""
        if self.rank != 0:
            return
        if self.logger is not None:
            self.logger.log(step, metrics)
        due = (step in (0, self.total_steps) or step % self.line.every == 0
               or any(key.startswith("eval/") for key in metrics))
        if due if line is None else line:
            self.line.say(step_line(step, self.total_steps, metrics, self.line.shown, self.line.prefix))

    def save(self, step: int) -> Path | None:
        """Collective: a checkpoint of the trained models and the job's state at `step` (None back: it could not
        be written, said why, and `trainer.on_checkpoint_error=continue` trains on)."""
        return self.checkpointer.save(step, self.trained, self.state())

    def run_steps(self, one_step: Callable[[int], dict], device, progress: StepProgress, *,
                  evaluate: Callable[[int], dict] | None = None, eval_due: Callable[[int], bool] = lambda step: False,
                  log: Callable[[int, dict], None] | None = None, first_phase: str = "update") -> None:
        """Steps `start_step + 1 .. total_steps` on the shared loop, after the evaluation at step 0 that every later
        one compares with (a fresh run whose `eval_due(0)`). `log`: the job's own log of a step (default `log`)."""
        log = log or self.log
        if evaluate is not None and self.start_step == 0 and eval_due(0):
            progress.at(0, "evaluation")
            log(0, evaluate(0))
        hooks = StepHooks(one_step=one_step, log=log, save=self.save, evaluate=evaluate, eval_due=eval_due,
                          first_phase=first_phase)
        run_steps(hooks, self.start_step, self.total_steps, self.trainer, self.rank, device, progress)

    def finish(self, export: Callable[[], None] | None = None) -> None:
        """The job's export (collective when sharded), then rank 0's logger closed, whatever the export did."""
        try:
            if export is not None:
                export()
        finally:
            self.close()

    def close(self) -> None:
        if self.logger is not None:
            self.logger.close()
            self.logger = None
