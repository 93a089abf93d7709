"""The step loop every training job shares (PPO, SFT, DPO): what happens around a step is written once here,
what a step does is the job's.

Around each step: where the job is (for the line a stop signal ends with), the `trainer.profile_steps`
trace, the step's time, an evaluation when the job says one is due, the job's log row, and a checkpoint
every `trainer.save_every` steps. A checkpoint that could not be written (`trainer.on_checkpoint_error=
continue`) is counted in `checkpoint/failed` in every later row, so a run that trained on without
checkpoints says so. Around all the steps, the objects built before the first step are kept out of
Python's full collections (`setup_objects_frozen`).
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from rl_core.profiling import profile_step
from rl_core.stop_signal import StepProgress
from workers.gc_freeze import setup_objects_frozen
from workers.trace import span


@dataclass(frozen=True)
class StepHooks:
    """What a job gives the loop.

    `one_step(step)` trains step `step` (0-based) and returns its metrics (its own `perf/step_s` wins, e.g.
    PPO's phase timer). `evaluate(step)` the held-out metrics after `step` steps, when `eval_due(step)` (None:
    the job has no held-out data). `log(step, metrics)` writes the row and the console line (rank 0).
    `save(step)` writes a checkpoint, None back when it could not be written. `first_phase`: what a stop
    signal at the start of a step interrupts."""

    one_step: Callable[[int], dict]
    log: Callable[[int, dict], None]
    save: Callable[[int], Path | None]
    evaluate: Callable[[int], dict] | None = None
    eval_due: Callable[[int], bool] = lambda step: False
    first_phase: str = "update"


def run_steps(job: StepHooks, start_step: int, total_steps: int, trainer, rank: int, device,
              progress: StepProgress) -> None:
    """Steps `start_step + 1 .. total_steps` as logged; `trainer`: the job's trainer section (save_every,
    profile_steps, run_dir)."""
    # Everything built before the first step lives all job long: full collections skip it (see the helper).
    with setup_objects_frozen():
        _steps(job, start_step, total_steps, trainer, rank, device, progress)
    progress.at(total_steps, "export")


def _steps(job: StepHooks, start_step: int, total_steps: int, trainer, rank: int, device,
           progress: StepProgress) -> None:
    failed_saves = 0
    for step in range(start_step, total_steps):
        progress.at(step + 1, job.first_phase)
        with profile_step(trainer.profile_steps, step + 1, trainer.run_dir, rank, device) as profiled:
            started = time.perf_counter()  # inside: the profiler's start and the trace's export are not the step's
            with span("train step"):
                metrics = job.one_step(step)
            metrics.setdefault("perf/step_s", time.perf_counter() - started)
        metrics.update(profiled)  # a profiled step's device reads and kernel-level ops
        if device.type == "cuda":  # the trainer's own peak, beside the memory plan's estimate (no device sync)
            metrics["memory/trainer_peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            torch.cuda.reset_peak_memory_stats(device)
        else:  # the process's peak resident memory so far (Linux: KiB), runtime included
            metrics["memory/trainer_peak_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        if failed_saves:
            metrics["checkpoint/failed"] = failed_saves
        if job.evaluate is not None and job.eval_due(step + 1):  # not in perf/step_s
            progress.at(step + 1, "evaluation")
            started = time.perf_counter()
            metrics.update(job.evaluate(step + 1))
            metrics["perf/eval_s"] = time.perf_counter() - started
        job.log(step + 1, metrics)
        # Saved after the step is logged: a run killed in between resumes from the previous checkpoint
        # and logs this step again (the resumed logger drops the extra row), so no step goes missing.
        if trainer.save_every and (step + 1) % trainer.save_every == 0:
            progress.at(step + 1, "checkpoint")
            failed_saves += job.save(step + 1) is None
