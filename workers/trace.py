"""Named ranges in `torch.profiler` traces (`trainer.profile_steps`): the step's phases, the model passes
and every HTTP call to an engine or the router show under their names in Perfetto or TensorBoard.

`span(name)` is a no-op unless a profiler is running, so code can name its ranges unconditionally.
"""

from __future__ import annotations

import contextlib
import sys


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
