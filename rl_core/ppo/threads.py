"""How a PPO rank's cores are split between its trainer and its engine, which share the node: in sync mode
they take turns, in async mode they compute at once.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from rl_core.lifecycle import torch_threads


class ThreadPolicy:
    """The torch threads of a PPO rank's engine and trainer. A part of `PPORuntime` (rl_core/ppo/runtime.py),
    whose job lifecycle gives `cpu_threads()` (this rank's cores) and `device`, and whose `cfg` the mode."""

    def engine_threads(self) -> int:
        """An embedded engine's torch threads. Sync mode: all of this rank's cores but one, which the engine's HTTP
        front end, the router and rank 0's rollout client need while it decodes (with every core, each of its
        parallel ops waited at an OpenMP barrier for a thread those had descheduled: the gpu86m shape on 2 cores,
        alternated runs, a 256 x 48-token busy period 0.36-0.37 s with 2 threads, 0.29 s with 1). Async mode:
        half of them, since it decodes while the trainer computes on every core (2 + 2 threads on 2 cores made
        each wait on the other's: 2.5-2.7 s a step against 2.2-2.4 s with the engine on 1)."""
        cores = self.cpu_threads()
        return max(1, cores - 1) if self.cfg.trainer.mode == "sync" else max(1, cores // 2)

    def trainer_threads(self) -> int:
        """The trainer's torch threads: all of this rank's cores, in async mode too: the engine decodes for part of
        the step only (one batch per step, 0.3 s of a 1.1 s step for the gpu86m shape on 2 cores), and a trainer
        on the cores it leaves would leave one idle the rest of the time (alternated runs: 1.01-1.14 s a step
        with 2 trainer threads beside the engine's 1, 1.22-1.24 s with 1).

        On a GPU, one: the trainer's CPU tensors are bookkeeping (layouts, advantages), and with more threads
        each small op waits at an OpenMP barrier for a thread that shares a core with a busy neighbour, such as
        SGLang's scheduler, which polls while idle (one H200, gpu86m: torch's 16 threads made each CPU
        `index` 6-8 ms, 0.38 s of a 0.59 s reference forward)."""
        return self.cpu_threads() if self.device.type == "cpu" else 1

    @contextlib.contextmanager
    def threads_beside_decoding(self) -> Iterator[None]:
        """For the trainer's work that overlaps its engine's decoding: in async mode on CPU the engine starts on the
        next batch when a push ends, so the next step's forward passes run beside it; on the cores it leaves, its
        parallel ops wait on no descheduled thread (the gpu86m shape on 2 cores, alternated runs: those passes
        0.57-0.59 s with 2 threads, 0.45-0.47 s with 1)."""
        if self.device.type != "cpu" or self.cfg.trainer.mode == "sync":
            yield
            return
        with torch_threads(max(1, self.cpu_threads() - self.engine_threads())):
            yield
