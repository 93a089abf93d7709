"""`trainer.profile_steps`: a `torch.profiler` trace of each listed step, one file per rank.

`<run_dir>/profile/step_<N>/rank<R>.pt.trace.json` is Chrome trace JSON: Perfetto (ui.perfetto.dev) and
chrome://tracing open it, and TensorBoard's PyTorch profiler plugin (`pip install torch-tb-profiler`,
`tensorboard --logdir <run_dir>/profile`) shows each step as a run and each rank as a worker. The
phases, model passes and engine HTTP calls are named ranges (`workers.trace.span`).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Iterator, Sequence

import torch
from torch.profiler import ProfilerActivity, profile


def profile_step(steps: Sequence[int], step: int, run_dir: str | Path, rank: int, device: torch.device):
    """Profile step `step` (1-based, as logged) when `steps` (trainer.profile_steps) lists it; otherwise
    a null context, so an unprofiled step creates no profiler at all."""
    if step not in steps:
        return contextlib.nullcontext()
    return _profiled(Path(run_dir) / "profile" / f"step_{step}" / f"rank{rank}.pt.trace.json", step, rank, device)


@contextlib.contextmanager
def _profiled(path: Path, step: int, rank: int, device: torch.device) -> Iterator[None]:
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda" and torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    all_threads = _all_threads_config()
    with profile(activities=activities, experimental_config=all_threads) as prof:
        yield
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    note = "" if all_threads is not None else " (this torch records the main thread only: no rollout spans)"
    # One write: every rank prints this line at once, and print's separate write of the newline could
    # land after another rank's output (unbuffered streams under torchrun).
    sys.stdout.write(f"[rank {rank}] profile of step {step}: {path}{note}\n")
    sys.stdout.flush()


def _all_threads_config():
    """The profiler records only the thread that started it unless told otherwise, and rank 0's rollout
    sends its /generate calls from its own asyncio thread (rl_core.rollout.service): ask for every thread
    of the process (`profile_all_threads`, which torch 2.13 has). None on a torch without it."""
    try:
        return torch.profiler._ExperimentalConfig(profile_all_threads=True)
    except TypeError:
        return None
