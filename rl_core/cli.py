"""Command-line front door shared by the jobs: `--config NAME_OR_PATH key=value ...`, and how a job ends.

`run_main` wraps a job's `main` so that every way it can stop ends with one line that says
why: a failure prints `[rank R] error: <what, and the fix>` (with the traceback above it only
for unexpected errors, i.e. bugs), SIGINT/SIGTERM print `stopped by SIGTERM at step N (phase)`
once (rank 0), and a rank that only lost contact with a failed peer says so instead of a gloo
traceback. Which line a failure gets is `rl_core/failures.py`'s; a stop signal ends the rank within
`STOP_GRACE_S` whatever its main thread is doing (`rl_core/stop_signal.py`). The same
line goes into torchrun's error file (torch.distributed.elastic's `record` mechanism), so
torchrun's failure summary shows it instead of "To enable traceback see ...".
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from torch.distributed.elastic.multiprocessing.errors import record

from rl_core.config import ConfigError, load_config
from rl_core.distributed import prepare_before_process_group
from rl_core.failures import OneLineErrorHandler, ending, say
from rl_core.lifecycle import RankLifecycle
from rl_core.stop_signal import STOP_GRACE_S, STOP_SIGNALS, TEST_HOLD_ENV, StepProgress, StopRequest
from workers.procs import exit_now

# A rank that fails because another one did waits this long at most for the failed rank to exit first
# (`_wait_for_the_failed_rank`).
FOLLOWER_WAIT_S = 30.0


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
    runtime: Callable[[Any], RankLifecycle] | None = None
    children: str = ""


def run_job(argv: list[str] | None, entry: JobEntry, train: Callable, prepare=None) -> None:
    """Every job's whole life: its config (`prepare(cfg, log)`, the entry point's offline assets, then the
    models' check, all before any process group), then `train(cfg, runtime, progress)` inside its runtime,
    ended by `run_main` with one line and an exit code."""
    def job(args, progress: StepProgress):
        cfg = parse_job_config(args, entry.description, entry.default_config, entry.schema, entry.validate,
                               prepare, entry.check_models)
        with (entry.runtime(cfg) if entry.runtime else RankLifecycle(cfg.trainer)) as runtime:
            train(cfg, runtime, progress)

    run_main(job, argv, stop_hint="trainer.resume=auto continues from the last checkpoint", children=entry.children)


def run_main(main: Callable[[list[str] | None, StepProgress], None], argv: list[str] | None, stop_hint: str = "",
             children: str = "", stop_grace_s: float | None = STOP_GRACE_S) -> None:
    """Run a job's `main(argv, progress)` and end with one line and a meaningful exit code, whatever happens.

    `children`: what the job's clean-up stops, for the stop line ("engines and router"). `stop_grace_s`:
    see `StopRequest`; after a stop signal's clean-up the process ends with `os._exit`. None: no
    watchdog, and SystemExit instead of that exit (a test calling this in its own process)."""
    rank = int(os.environ.get("RANK", 0))
    progress = StepProgress(rank, os.environ.get(TEST_HOLD_ENV))
    handler = OneLineErrorHandler()
    stop = StopRequest(rank, handler, progress, stop_hint, children, stop_grace_s)
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
    # line said. A failed rank's process group is still open (RankLifecycle.close): this exit closes it
    # only now, so peers learn of the failure after its cause was printed. Python's own exit would
    # also tear down torch's and the models' objects one by one: seconds per rank on a busy CPU.
    if stop_grace_s is not None:
        exit_now(code)


def _exit_code(end: SystemExit) -> int:
    """The status Python's own exit would give `end` (a text is said, then 1)."""
    if end.code is None or isinstance(end.code, int):
        return end.code or 0
    say(str(end.code))
    return 1


def _run(main, argv, rank: int, stop: StopRequest, handler: OneLineErrorHandler, progress: StepProgress) -> None:
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
        end = ending(err, rank)
        if end.traceback:
            traceback.print_exception(err)
        handler.record_line(end.line, secondary=end.follower)
        if end.said:
            say(end.line)
        if end.wait:
            _wait_for_the_failed_rank(stop)
        raise SystemExit(1) from None


def _wait_for_the_failed_rank(stop: StopRequest, limit_s: float = FOLLOWER_WAIT_S) -> None:
    """A rank that only followed a failed one down waits for torchrun's SIGTERM (sent once the failed
    rank exits) before it exits itself: exiting first would have torchrun SIGTERM the failed rank,
    maybe before it said why (its line comes after its clean-up). At most `limit_s`, in case the failed
    rank's clean-up hangs. The signal's handler (`StopRequest.handle`) ends the wait; the exit stays
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


def _stopped(stop: StopRequest) -> None:
    stop.say(overdue=False)
    if stop.grace_s is not None:
        # The clean-up is done (children stopped, run directory free). Python's own exit would now
        # destroy the process groups the job left open (see RankLifecycle.close) and join threads,
        # either of which can wait on a peer or a stuck call: end the process here instead.
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except OSError:
                pass
        os._exit(128 + stop.signum)
    raise SystemExit(128 + stop.signum) from None
