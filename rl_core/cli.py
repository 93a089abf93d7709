"""Command-line front door shared by the jobs: `--config NAME_OR_PATH key=value ...`, and how a job ends.

`run_main` wraps a job's `main` so that every way it can stop ends with one line that says
why: a failure prints `[rank R] error: <what, and the fix>` (with the traceback above it only
for unexpected errors, i.e. bugs), SIGINT/SIGTERM print `stopped by SIGTERM at step N (phase)`
once (rank 0), and a rank that only lost contact with a failed peer says so instead of a gloo
traceback. A stop signal ends the rank within `STOP_GRACE_S` whatever its main thread is doing
(see `_StopRequest`). The same
line goes into torchrun's error file (torch.distributed.elastic's `record` mechanism), so
torchrun's failure summary shows it instead of "To enable traceback see ...".
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

from rl_core.config import ConfigError, load_config
from rl_core.distributed import prepare_before_process_group
from rl_core.errors import JobError, PeerFailed, PreferenceDataError
from rl_core.lifecycle import JobLifecycle
from workers.procs import exit_now, kill_children

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# After a stop signal the rank's orderly clean-up (engines, router, process group) has this long;
# then the watchdog kills its children and exits, so torchrun (which escalates to SIGKILL only
# after 30 s, and without the line) sees every rank gone within seconds.
STOP_GRACE_S = 5.0
# A rank that fails because another one did waits this long at most for the failed rank to exit first
# (`_wait_for_the_failed_rank`).
FOLLOWER_WAIT_S = 30.0
# Test-only: "RANK:STEP:PHASE:SECONDS" makes that rank say when it reaches that phase of that step
# and sleep there, so a test can land a stop signal in any phase (the other ranks go on into it).
TEST_HOLD_ENV = "RL_CORE_TEST_HOLD"


def parse_job_config(argv: list[str] | None, description: str, default_config: str, schema: type,
                     validate: Callable[[Any], None] | None = None,
                     prepare: Callable[[Any, Callable[[str], None]], Any] | None = None,
                     check_models: Callable[[Any], None] | None = None):
    """Parse the command line and return a validated config, or exit 2 with one clear line.

    `prepare(cfg, log)` (an entry point's: the offline assets the recipe names) then gives the config
    the job runs with; it runs on every rank before any process group exists, so however long it
    takes no rank waits for it inside a collective. `check_models(cfg)` then checks the config against
    the models it names (their configs only, e.g. the context length), still before anything starts."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", default=default_config,
                        help="recipe path, or a bare name under configs/ (default: %(default)s)")
    parser.add_argument("overrides", nargs="*", help="OmegaConf dotlist overrides, e.g. trainer.total_episodes=256")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides, schema=schema, validate=validate)
        if prepare is not None:
            cfg = prepare_before_process_group(lambda log: prepare(cfg, log), "prepare the offline assets")
        if check_models is not None:
            check_models(cfg)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    return cfg


def _is_user_error(err: BaseException) -> bool:
    """Failures whose message is the whole story: the traceback would only bury it."""
    from envs.pool import TooManyEnvFailures
    from envs.sandbox import SandboxError
    from rl_core.data import PromptDataError
    from workers.engines.client import EngineError
    from workers.loading import ModelPathError
    from workers.procs import ProcessStartError

    return isinstance(err, (JobError, ConfigError, PromptDataError, TooManyEnvFailures, EngineError,
                            ProcessStartError, ModelPathError, PreferenceDataError, FileNotFoundError, SandboxError))


def _lost_peer(err: BaseException) -> bool:
    """A collective failed because another rank went away (gloo: "Connection closed by peer"). Only
    the process group's own errors count: an engine call that met a reset connection is this rank's."""
    text = str(err)
    in_collective = "gloo" in text or "nccl" in text.lower() or "ProcessGroup" in text
    return isinstance(err, RuntimeError) and in_collective and (
        "Connection closed by peer" in text or "Connection reset by peer" in text or "Broken pipe" in text)


class OneLineErrorHandler(ErrorHandler):
    """torchrun's error file holding the one line instead of a traceback: its summary prints that line."""

    def record_line(self, line: str, secondary: bool = False) -> None:
        path = self._get_error_file_path()
        if not path:
            return
        # torchrun names the failure with the earliest timestamp the root cause; a rank that only
        # followed another one down is dated later so it never hides the real cause.
        stamp = int(time.time()) + (60 if secondary else 0)
        # torch's layout, with the one line where the traceback would be: the summary prints py_callstack.
        data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(stamp)}}}
        self._write_error_file(path, json.dumps(data))

    def record_exception(self, e: BaseException) -> None:
        self.record_line(failure_line(e))


def failure_line(err: BaseException) -> str:
    """The error as one line: the message alone for a user error (it names the key and the fix), else with its type."""
    text = str(err).strip() or type(err).__name__
    if isinstance(err, PeerFailed) or _is_user_error(err):
        return text
    return f"{type(err).__name__}: {text}"


class JobProgress:
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


class _StopRequest:
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

    def __init__(self, rank: int, handler: "OneLineErrorHandler", progress: JobProgress, hint: str,
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
            _say(line)


@dataclass(frozen=True)
class JobEntry:
    """A job as its entry point starts it: its config (`description` for --help, the recipe run without
    --config, the schema, its validation, and `check_models`, the config against the models it names) and the
    runtime its `train(cfg, runtime, progress)` runs in: the shared lifecycle (process group, cores, run
    directory lock) unless `runtime(cfg)` gives one that adds to it (PPO's engines, router and rollout
    service; `children` names those for the line a stop signal ends with)."""
    description: str
    default_config: str
    schema: type
    validate: Callable[[Any], None] | None = None
    check_models: Callable[[Any], None] | None = None
    runtime: Callable[[Any], JobLifecycle] | None = None
    children: str = ""


def run_job(argv: list[str] | None, entry: JobEntry, train: Callable, prepare=None) -> None:
    """Every job's whole life: its config (`prepare(cfg, log)`, the entry point's offline assets, then the
    models' check, all before any process group), then `train(cfg, runtime, progress)` inside its runtime,
    ended by `run_main` with one line and an exit code."""
    def job(args, progress: JobProgress):
        cfg = parse_job_config(args, entry.description, entry.default_config, entry.schema, entry.validate,
                               prepare, entry.check_models)
        with (entry.runtime(cfg) if entry.runtime else JobLifecycle(cfg.trainer)) as runtime:
            train(cfg, runtime, progress)

    run_main(job, argv, stop_hint="trainer.resume=auto continues from the last checkpoint", children=entry.children)


def run_main(main: Callable[[list[str] | None, JobProgress], None], argv: list[str] | None, stop_hint: str = "",
             children: str = "", stop_grace_s: float | None = STOP_GRACE_S) -> None:
    """Run a job's `main(argv, progress)` and end with one line and a meaningful exit code, whatever happens.

    `children`: what the job's clean-up stops, for the stop line ("engines and router"). `stop_grace_s`:
    see `_StopRequest`; after a stop signal's clean-up the process ends with `os._exit`. None: no
    watchdog, and SystemExit instead of that exit (a test calling this in its own process)."""
    rank = int(os.environ.get("RANK", 0))
    progress = JobProgress(rank, os.environ.get(TEST_HOLD_ENV))
    handler = OneLineErrorHandler()
    stop = _StopRequest(rank, handler, progress, stop_hint, children, stop_grace_s)
    stop.install()
    code = 0
    try:
        _run(main, argv, rank, stop, handler, progress)
    except SystemExit as end:
        if stop_grace_s is None:
            raise
        code = _exit_code(end)
    finally:
        # The outcome is decided: a SIGTERM torchrun sends while this rank shuts down must not turn
        # the exit into a death by signal (Python restores default handlers as it finalizes).
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        stop.uninstall()
    # Cleaned up (engines and router stopped, run directory free, logs closed) and, on a failure, the
    # line said. A failed rank's process group is still open (JobLifecycle.close): this exit closes it
    # only now, so peers learn of the failure after its cause was printed. Python's own exit would
    # also tear down torch's and the models' objects one by one: seconds per rank on a busy CPU.
    if stop_grace_s is not None:
        exit_now(code)


def _exit_code(end: SystemExit) -> int:
    """The status Python's own exit would give `end` (a text is said, then 1)."""
    if end.code is None or isinstance(end.code, int):
        return end.code or 0
    _say(str(end.code))
    return 1



def _run(main, argv, rank: int, stop: _StopRequest, handler: OneLineErrorHandler, progress: JobProgress) -> None:
    try:
        # torch's `record`: writes torchrun's error file for any exception that escapes `main`.
        record(main, error_handler=handler)(argv, progress)
    except SystemExit:
        if stop.signum is None:
            raise  # config errors (exit 2) and explicit exits already said what happened
        _stopped(stop)
    except BaseException as err:  # noqa: BLE001 - every failure ends with one line
        if stop.signum is not None:  # e.g. a collective broken by the peer that stopped first
            _stopped(stop)
        if isinstance(err, PeerFailed):  # the failing rank prints the cause; one line is enough
            handler.record_line(f"[rank {rank}] stopped: {err}", secondary=True)
            _wait_for_the_failed_rank(stop)
            raise SystemExit(1) from None
        failed = getattr(err, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failed, dict) and failed and rank not in failed:  # another rank died mid-save
            per_node = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
            cause = failed[min(failed)][0]
            line = (f"[rank {rank}] stopped: " + ", ".join(f"rank {r} (node {r // per_node})" for r in sorted(failed))
                    + f" failed while the checkpoint was written ({type(cause).__name__}: {cause}); see its log")
            handler.record_line(line, secondary=True)
            _say(line)
            if any(r // per_node == rank // per_node for r in failed):  # (one on another node prints in its own log)
                _wait_for_the_failed_rank(stop)
            raise SystemExit(1) from None
        if _lost_peer(err):
            peer = re.search(r"by peer \[?([0-9a-fA-F.:]+?)\]?:\d+", str(err))
            if peer and not peer.group(1).startswith("127."):  # another host: it may have no say of its own
                line = (f"[rank {rank}] stopped: the rank at {peer.group(1)} went away ({_first_line(err)}); if that "
                        "is another node, it died or lost its link: see its log")
            else:
                line = (f"[rank {rank}] stopped: another rank failed or exited first ({_first_line(err)}); "
                        "its error above (or in torchrun's summary) is the cause")
            handler.record_line(line, secondary=True)
            _say(line)
            if not peer or peer.group(1).startswith("127."):  # (a rank on another host prints in its own log)
                _wait_for_the_failed_rank(stop)
            raise SystemExit(1) from None
        if not _is_user_error(err):
            traceback.print_exception(err)
        line = f"[rank {rank}] error: {failure_line(err)}"
        handler.record_line(line)
        _say(line)
        raise SystemExit(1) from None


def _wait_for_the_failed_rank(stop: _StopRequest, limit_s: float = FOLLOWER_WAIT_S) -> None:
    """A rank that only followed a failed one down waits for torchrun's SIGTERM (sent once the failed
    rank exits) before it exits itself: exiting first would have torchrun SIGTERM the failed rank,
    maybe before it said why (its line comes after its clean-up). At most `limit_s`, in case the failed
    rank's clean-up hangs. The signal's handler (`_StopRequest.handle`) ends the wait; the exit stays
    this rank's own (status 1, its one line). Only in a job of several ranks with the stop watchdog (not
    in a test's own process)."""
    if stop.grace_s is None or int(os.environ.get("WORLD_SIZE", 1)) < 2:
        return
    deadline = time.monotonic() + limit_s
    try:
        while time.monotonic() < deadline:
            time.sleep(0.1)  # short: whichever thread the signal reaches, its handler runs here soon
    except SystemExit:
        pass


def _say(line: str) -> None:
    try:  # one write, so lines of ranks failing together do not interleave
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except OSError:  # torchrun (and the reading end of the pipe) may be gone
        pass


def _stopped(stop: _StopRequest) -> None:
    stop.say(overdue=False)
    if stop.grace_s is not None:
        # The clean-up is done (children stopped, run directory free). Python's own exit would now
        # destroy the process groups the job left open (see JobLifecycle.close) and join threads,
        # either of which can wait on a peer or a stuck call: end the process here instead.
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except OSError:
                pass
        os._exit(128 + stop.signum)
    raise SystemExit(128 + stop.signum) from None


def _first_line(err: BaseException) -> str:
    line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return line if len(line) <= 160 else line[:157] + "..."
