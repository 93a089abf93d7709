"""A stop signal (SIGINT, SIGTERM) ends a rank in order, with one line that says where the job was, and within
`STOP_GRACE_S` whatever its main thread is doing: `StepProgress` is where the job is, `StopRequest` the orderly
stop and its watchdog. `run_main` (rl_core/cli.py) installs both around a job.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from rl_core.failures import OneLineErrorHandler, say
from workers.procs import kill_children

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# After a stop signal the rank's orderly clean-up (engines, router, process group) has this long;
# then the watchdog kills its children and exits, so torchrun (which escalates to SIGKILL only
# after 30 s, and without the line) sees every rank gone within seconds.
STOP_GRACE_S = 5.0
# Test-only: "RANK:STEP:PHASE:SECONDS" makes that rank say when it reaches that phase of that step
# and sleep there, so a test can land a stop signal in any phase (the other ranks go on into it).
TEST_HOLD_ENV = "RL_CORE_TEST_HOLD"


class StepProgress:
    """Where a job is, for the line a stop signal ends with. `run_main` makes one per run and
    passes it to the job, which calls `at(step, phase)` as it goes; the stop watchdog's thread
    reads it (two attribute writes, each atomic under the GIL)."""

    def __init__(self, rank: int = 0, test_hold: str | None = None):
        self.rank = rank
        self.step: int | None = None  # the step being run (as metrics.jsonl numbers it), once known
        self.phase = "start-up"
        self._hold = None
        if test_hold:
            hold_rank, step, phase, seconds = test_hold.split(":", 3)
            if int(hold_rank) == rank:
                self._hold = (int(step), phase, float(seconds))

    def at(self, step: int | None, phase: str) -> None:
        self.step, self.phase = step, phase
        if self._hold is not None and self._hold[:2] == (step, phase):
            seconds, self._hold = self._hold[2], None  # once: a phase may be announced twice (the loop, the step)
            print(f"[rank {self.rank}] test hold: step {step} ({phase}) for {seconds:g}s", flush=True)
            time.sleep(seconds)

    def where(self) -> str:
        return f"at step {self.step} ({self.phase})" if self.step is not None else f"during {self.phase}"


class StopRequest:
    """SIGINT/SIGTERM: an orderly stop, and a watchdog in case it cannot happen.

    The first signal raises SystemExit in the main thread (so every `finally` and `__exit__` runs
    and stops engines and router); later ones are noted, not raised, so a second Ctrl-C or
    torchrun's follow-up SIGTERM cannot cut the clean-up short. Python runs that handler only
    between bytecodes of the main thread: a rank blocked in a gloo collective (waiting for a peer
    that is itself stuck) or in a clean-up that hangs would never get there. So the C-level
    handler also writes the signal's number to a pipe (`signal.set_wakeup_fd`), which a thread
    reads whatever the main thread does; `grace_s` later, if the process still lives, that thread
    says the line, kills this rank's children and `os._exit`s with 128 + the signal's number. It
    stays armed until the process is gone: Python's own exit can wait on threads too."""

    def __init__(self, rank: int, handler: OneLineErrorHandler, progress: StepProgress, hint: str,
                 children: str, grace_s: float | None):
        self.rank, self.handler, self.progress, self.hint, self.children = rank, handler, progress, hint, children
        self.grace_s = grace_s
        self.signum: int | None = None
        self._raised = False  # main thread only
        self._lock = threading.Lock()  # the first signal and the one line: main thread or watchdog
        self._said = False
        self._wakeup: tuple[int, int] | None = None
        self._previous_wakeup_fd = -1
        self._closing = False

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self.handle)
        if self.grace_s is None:
            return
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # the C handler must never block
        self._wakeup = (read_fd, write_fd)
        self._previous_wakeup_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, name="stop-watchdog", daemon=True).start()

    def uninstall(self) -> None:
        """The job ended without a stop signal: no watchdog needed any more."""
        if self._wakeup is None or self.signum is not None:
            return  # a stopping process keeps its watchdog until it is gone
        signal.set_wakeup_fd(self._previous_wakeup_fd)
        self._closing = True
        os.write(self._wakeup[1], b"\0")  # wakes the watchdog, which closes the pipe
        os.close(self._wakeup[1])

    def handle(self, signum: int, frame=None) -> None:
        self._note(signum)
        if self._raised:
            return
        self._raised = True
        raise SystemExit(128 + self.signum)

    def _note(self, signum: int) -> None:
        with self._lock:
            if self.signum is None:
                self.signum = signum

    def _watch(self) -> None:
        read_fd = self._wakeup[0]
        while True:
            data = os.read(read_fd, 64)
            if self._closing or not data:
                os.close(read_fd)
                return
            stops = [number for number in data if number in STOP_SIGNALS]
            if stops:
                break
        self._note(stops[0])
        time.sleep(self.grace_s)
        self.say(overdue=True)
        kill_children()
        os._exit(128 + self.signum)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def say(self, overdue: bool) -> None:
        """The one line, once per process (rank 0 prints it; every rank writes torchrun's error file)."""
        with self._lock:
            if self._said:
                return
            self._said = True
        if overdue:
            what = f"; its clean-up took over {self.grace_s:g} s, so " + (
                f"{self.children} were killed" if self.children else "it was cut short")
        else:
            what = f"; {self.children} were shut down" if self.children else ""
        line = (f"[rank {self.rank}] stopped by {self.name} {self.progress.where()}{what}"
                + (f"; {self.hint}" if self.hint else ""))
        # Other ranks are mostly stopped by torchrun because some rank failed: never the root cause.
        self.handler.record_line(line, secondary=self.rank != 0)
        if self.rank == 0:  # torchrun passes a Ctrl-C to every rank: one line is enough
            say(line)
