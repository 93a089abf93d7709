"""Command-line front door shared by the jobs: `--config NAME_OR_PATH key=value ...`, and how a job ends.

`run_main` wraps a job's `main` so that every way it can stop ends with one line that says
why: a failure prints `[rank R] error: <what, and the fix>` (with the traceback above it only
for unexpected errors, i.e. bugs), SIGINT/SIGTERM print `stopped by SIGINT ...` once, and a
rank that only lost contact with a failed peer says so instead of a gloo traceback. The same
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
import time
import traceback
from typing import Any, Callable

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

from rl_core.config import ConfigError, load_config
from rl_core.distributed import prepare_before_process_group
from rl_core.errors import JobError, PeerFailed, PreferenceDataError

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


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
    from rl_core.data import PromptDataError
    from workers.engines.client import EngineError
    from workers.loading import ModelPathError
    from workers.procs import ProcessStartError

    return isinstance(err, (JobError, ConfigError, PromptDataError, TooManyEnvFailures, EngineError,
                            ProcessStartError, ModelPathError, PreferenceDataError, FileNotFoundError))


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


class _StopRequest:
    """The first SIGINT/SIGTERM raises SystemExit in the main thread (so every `finally` and
    `__exit__` runs and stops engines and router); later ones are noted, not raised, so a second
    Ctrl-C or torchrun's follow-up SIGTERM cannot cut the clean-up short."""

    def __init__(self):
        self.signum: int | None = None

    def handle(self, signum: int, frame=None) -> None:
        if self.signum is not None:
            return
        self.signum = signum
        raise SystemExit(128 + signum)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""


def run_main(main: Callable[[list[str] | None], None], argv: list[str] | None, stop_hint: str = "") -> None:
    """Run a job's `main(argv)` and end with one line and a meaningful exit code, whatever happens."""
    rank = int(os.environ.get("RANK", 0))
    stop = _StopRequest()
    for sig in STOP_SIGNALS:
        signal.signal(sig, stop.handle)
    try:
        _run(main, argv, rank, stop, OneLineErrorHandler(), stop_hint)
    finally:
        # The outcome is decided: a SIGTERM torchrun sends while this rank shuts down must not turn
        # the exit into a death by signal (Python restores default handlers as it finalizes).
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


def _run(main, argv, rank: int, stop: _StopRequest, handler: OneLineErrorHandler, stop_hint: str) -> None:
    try:
        # torch's `record`: writes torchrun's error file for any exception that escapes `main`.
        record(main, error_handler=handler)(argv)
    except SystemExit:
        if stop.signum is None:
            raise  # config errors (exit 2) and explicit exits already said what happened
        _stopped(stop, rank, handler, stop_hint)
    except BaseException as err:  # noqa: BLE001 - every failure ends with one line
        if stop.signum is not None:  # e.g. a collective broken by the peer that stopped first
            _stopped(stop, rank, handler, stop_hint)
        if isinstance(err, PeerFailed):  # the failing rank prints the cause; one line is enough
            handler.record_line(f"[rank {rank}] stopped: {err}", secondary=True)
            raise SystemExit(1) from None
        failed = getattr(err, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failed, dict) and failed and rank not in failed:  # another rank died mid-save
            per_node = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
            cause = failed[min(failed)][0]
            line = (f"[rank {rank}] stopped: " + ", ".join(f"rank {r} (node {r // per_node})" for r in sorted(failed))
                    + f" failed while the checkpoint was written ({type(cause).__name__}: {cause}); see its log")
            handler.record_line(line, secondary=True)
            _say(line)
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
            raise SystemExit(1) from None
        if not _is_user_error(err):
            traceback.print_exception(err)
        line = f"[rank {rank}] error: {failure_line(err)}"
        handler.record_line(line)
        _say(line)
        raise SystemExit(1) from None


def _say(line: str) -> None:
    try:  # one write, so lines of ranks failing together do not interleave
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except OSError:  # torchrun (and the reading end of the pipe) may be gone
        pass


def _stopped(stop: _StopRequest, rank: int, handler: OneLineErrorHandler, hint: str) -> None:
    line = f"[rank {rank}] stopped by {stop.name}; engines and router were shut down" + (f"; {hint}" if hint else "")
    # Other ranks are mostly stopped by torchrun because some rank failed: never the root cause.
    handler.record_line(line, secondary=rank != 0)
    if rank == 0:  # torchrun passes a Ctrl-C to every rank: one line is enough
        _say(line)
    raise SystemExit(128 + stop.signum) from None


def _first_line(err: BaseException) -> str:
    line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return line if len(line) <= 160 else line[:157] + "..."
