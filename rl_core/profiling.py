"""`trainer.profile_steps`: a `torch.profiler` trace of each listed step, one file per rank.

`<run_dir>/profile/step_<N>/rank<R>.pt.trace.json` is Chrome trace JSON: Perfetto (ui.perfetto.dev) and
chrome://tracing open it, and TensorBoard's PyTorch profiler plugin (`pip install torch-tb-profiler`,
`tensorboard --logdir <run_dir>/profile`) shows each step as a run and each rank as a worker. The
phases, model passes and engine HTTP calls are named ranges (`workers.trace.span`).

A profiled step also counts what the issue of the GPU step asked to keep low, and logs them with the step:
`profile/device_reads`, the reads back to the host of tensors computed on the training device (`DeviceReads`:
on a GPU each waits until the device has finished everything queued), and `profile/kernel_ops`, the
outermost aten ops the trainer's thread dispatched (on a GPU each is at least one kernel launch).
"""

from __future__ import annotations

import contextlib
import sys
import traceback
import weakref
from pathlib import Path
from typing import Iterator, Sequence

import torch
from torch.overrides import TorchFunctionMode
from torch.profiler import ProfilerActivity, profile
from torch.utils._pytree import tree_flatten


def profile_step(steps: Sequence[int], step: int, run_dir: str | Path, rank: int, device: torch.device):
    """Profile step `step` (1-based, as logged) when `steps` (trainer.profile_steps) lists it; otherwise
    a null context, so an unprofiled step creates no profiler at all. Entered, it gives a dict that holds
    the step's counts (`profile/device_reads`, `profile/kernel_ops`) once it exits: the step's metrics."""
    if step not in steps:
        return contextlib.nullcontext({})
    return _profiled(Path(run_dir) / "profile" / f"step_{step}" / f"rank{rank}.pt.trace.json", step, rank, device)


@contextlib.contextmanager
def _profiled(path: Path, step: int, rank: int, device: torch.device) -> Iterator[dict]:
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda" and torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    all_threads = _all_threads_config()
    counts: dict[str, float] = {}
    with profile(activities=activities, experimental_config=all_threads) as prof, DeviceReads() as reads:
        with torch.profiler.record_function(STEP_RANGE):  # marks this thread among the profiler's
            yield counts
    counts["profile/device_reads"] = float(len(reads.reads))
    counts["profile/kernel_ops"] = float(outermost_aten_ops(prof))
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    note = "" if all_threads is not None else " (this torch records the main thread only: no rollout spans)"
    # One write: every rank prints this line at once, and print's separate write of the newline could
    # land after another rank's output (unbuffered streams under torchrun).
    sys.stdout.write(f"[rank {rank}] profile of step {step}: {path}{note}\n[rank {rank}] step {step}: "
                     f"{len(reads.reads)} device reads ({', '.join(reads.where) or 'none'}), "
                     f"{int(counts['profile/kernel_ops'])} kernel-level ops\n")
    sys.stdout.flush()


STEP_RANGE = "profiled step"


def outermost_aten_ops(prof: profile) -> int:
    """The aten ops the step's thread dispatched itself (not those an op ran inside it): the profiler numbers
    threads in its own way, so the thread is the one that recorded `STEP_RANGE`."""
    events = prof.events()
    thread = next(event.thread for event in events if event.name == STEP_RANGE)
    return sum(1 for event in events if event.thread == thread and event.name.startswith("aten::")
               and (event.cpu_parent is None or not event.cpu_parent.name.startswith("aten::")))


READS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "nonzero", "cpu", "numpy"}


class DeviceReads(TorchFunctionMode):
    """Reads back to the host, in this thread, of tensors that live on the training device.

    On a GPU that is a read of a CUDA tensor. On CPU there is one device, so "on the training device" is
    followed from where it starts: model parameters (`models`, and every `nn.Parameter` an op is given, which
    covers FSDP's unsharded ones) and their gradients, every tensor moved to the device without blocking (what
    `workers.layout.to_device` does with a micro-batch), and every result of an op that reads one of those. A
    read (`.item()`, `.tolist()`, `bool()`, `.cpu()`, a `nonzero`, a boolean-mask index) of such a tensor is a
    host stall on a GPU; what the host builds from host data (the batch, its masks) is not. Why by hand: the
    profiler sees a GPU's syncs but not which CPU op would have been one."""

    def __init__(self, models: Sequence[torch.nn.Module] = ()):
        super().__init__()
        self.reads: list[str] = []
        self.where: list[str] = []  # the project's line that read
        self._on_device: dict[int, weakref.ref] = {}
        for model in models:
            for parameter in model.parameters():
                self._mark(parameter)

    def _mark(self, tensor: torch.Tensor) -> None:
        self._on_device[id(tensor)] = weakref.ref(tensor)

    def _is_on_device(self, tensor: torch.Tensor) -> bool:
        if tensor.device.type != "cpu" or isinstance(tensor, torch.nn.Parameter):
            return True
        ref = self._on_device.get(id(tensor))
        return ref is not None and ref() is tensor

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        on_device = any(self._is_on_device(t) for t in inputs)
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name == "to" and kwargs.get("non_blocking") and out is args[0]:
            out = out.clone()  # on CPU a move to "the device" returns its input: a copy, as a real transfer makes
        boolean_index = name == "__getitem__" and any(t.dtype == torch.bool for t in inputs[1:])
        if on_device and (name in READS or boolean_index):
            self.reads.append(name)
            self.where.append(f"{name} at {_project_frame()}")
            return out.clone() if out is args[0] else out  # what came back is on the host (on CPU `.cpu()` is
            # its input: a copy, as a real transfer makes)
        if on_device and (name.endswith("_") or name == "__setitem__") and isinstance(args[0], torch.Tensor):
            self._mark(args[0])  # written in place with device data
        if on_device or (name == "to" and kwargs.get("non_blocking")):
            for tensor in tree_flatten(out)[0]:
                if isinstance(tensor, torch.Tensor):
                    self._mark(tensor)
        return out


def _project_frame() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/rl_core/" in frame.filename or "/workers/" in frame.filename:
            return f"{frame.filename.split('/')[-2]}/{frame.filename.split('/')[-1]}:{frame.lineno}"
    return "?"


def _all_threads_config():
    """The profiler records only the thread that started it unless told otherwise, and in sync mode rank 0's
    rollout sends its /generate calls from its own asyncio thread (rl_core.rollout.service): ask for every
    thread of the process (`profile_all_threads`, which torch 2.13 has). None on a torch without it."""
    try:
        return torch.profiler._ExperimentalConfig(profile_all_threads=True)
    except TypeError:
        return None
