"""Named ranges in `torch.profiler` traces (`trainer.profile_steps`): the step's phases, the model passes
and every HTTP call to an engine or the router show under their names in Perfetto or TensorBoard.

`span(name)` is a no-op unless a profiler is running, so code can name its ranges unconditionally.
`StepTimer` times a step's phases for the log, each phase a span.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Iterator


def span(name: str):
    """A named range in the trace of a running profiler (any thread, coroutines included), else nothing.

    torch keeps a process-wide flag for this check (`torch.autograd.profiler._is_profiler_enabled`, set
    while any profiler runs): without a profiler, `record_function` alone would still be a dispatcher call
    each time (tens of microseconds per call on a busy CPU), on every /generate of every step.
    """
    profiler = sys.modules.get("torch.autograd.profiler")  # not imported: no profiler runs in this process
    if profiler is not None and getattr(profiler, "_is_profiler_enabled", True):
        from torch.profiler import record_function

        return record_function(name)
    return contextlib.nullcontext()


class StepTimer:
    """Wall time of each phase of one step: ``with timer("rollout"): ...``, then ``timer.metrics()``.
    Each phase is also a range of its name in a profiled step's trace."""

    def __init__(self):
        self.started = time.perf_counter()
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            with span(phase):
                yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        """``perf/<phase>_s`` for every phase, and ``perf/step_s`` from the timer's creation."""
        out = {f"perf/{phase}_s": seconds for phase, seconds in self.seconds.items()}
        out["perf/step_s"] = time.perf_counter() - self.started
        return out
