"""Process utilities shared by the engine and router launchers.

Every child runs in its own process group (so one signal reaches all its descendants), writes
stdout and stderr to one log file that starts with its command line, and gets SIGTERM from the
kernel if its parent dies (Linux PR_SET_PDEATHSIG), so no server outlives the job that started
it. The kernel ties that signal to the *thread* that forked the child, not the process: a child
started from a worker thread would be killed when that thread ends, so children are started
from the main thread only. Every deliberate stop writes who stopped the child, and why, into
the child's log. The ranks themselves follow their launcher the same way (`follow_launcher`):
torchrun puts each rank in its own session, so killing torchrun alone would leave them running.
Ports, addresses and the health probe are `workers/net.py`'s.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Mapping, Sequence

from rl_core.errors import UserError

PR_SET_PDEATHSIG = 1


class ProcessStartError(UserError, RuntimeError):
    """A child process died or did not answer in time while starting."""


def set_parent_death_signal(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send `sig` to this process when the thread that forked it exits (Linux only)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, sig)


def follow_launcher(grace_s: float = 15.0) -> None:
    """Under torchrun, stop this rank within seconds of torchrun's death (kill -9 included).

    torchrun starts every rank in its own session, so a signal to torchrun's process group never
    reaches the ranks: killed alone, torchrun would leave ranks, engines and router training
    unattended. The kernel sends this rank SIGTERM when torchrun exits (PR_SET_PDEATHSIG), which
    the job turns into its normal clean-up; a thread also polls the parent pid, in case torchrun
    died before the prctl. A rank still alive `grace_s` seconds later (stuck in a collective)
    SIGKILLs its children's process groups and exits. Call it first thing, before heavy imports.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # a plain `python -m` run has no launcher to follow
        return
    launcher = os.getppid()
    set_parent_death_signal(signal.SIGTERM)
    threading.Thread(target=_watch_launcher, args=(launcher, grace_s), name="launcher-watch", daemon=True).start()


def _watch_launcher(launcher: int, grace_s: float) -> None:
    while os.getppid() == launcher:
        time.sleep(0.5)
    stop_this_process(f"[rank {os.environ.get('RANK', 0)}] torchrun (pid {launcher}) is gone; stopping this rank, "
                      "its engine and the router", grace_s)


def exit_now(code: int) -> None:
    """End this process at once after a finished, cleaned-up run (a rank, an engine): what an orderly
    exit must still do runs first, `atexit` functions (logging's flush, multiprocessing's children,
    temporary directories) and the standard streams' flush; Python's own teardown of torch's and the
    models' objects, seconds of garbage collection on a busy CPU for nothing, is skipped."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:  # the reading end of the pipe (torchrun, the launcher) may be gone
            pass
    os._exit(code)


def stop_this_process(line: str, grace_s: float = 15.0) -> None:
    """From a watcher thread: say `line`, SIGTERM this process (the job's handler turns it into the
    normal clean-up) and, if it is still alive `grace_s` later (its main thread stuck in a collective
    with a peer that is gone), SIGKILL its children's process groups and exit."""
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:  # the reading end of torchrun's pipe may be gone
        pass
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    kill_children()
    os._exit(128 + signal.SIGTERM)


def kill_children() -> None:
    """SIGKILL every child of this process and the process group each one leads (engines and router
    do; reward workers too), for a process about to `os._exit` without its orderly clean-up."""
    for child in _children():
        _signal_group(child, signal.SIGKILL)
        try:
            os.kill(child, signal.SIGKILL)
        except OSError:
            pass


def _children() -> list[int]:
    me, found = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2:].split()[1]) == me:
                found.append(int(entry.name))
    return found


def _die_with_parent() -> None:
    """preexec_fn: ask the kernel to SIGTERM this child when the parent thread exits."""
    set_parent_death_signal(signal.SIGTERM)


def start_process(argv: Sequence[str], log_path: str | Path,
                  env: Mapping[str, str] | None = None) -> subprocess.Popen:
    """Start `argv` in its own process group with stdout+stderr appended to `log_path`."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("start child processes from the main thread: the kernel's parent-death signal "
                           "follows the forking thread, so the child would die when this thread ends")
    log_command(log_path, argv)
    with open(log_path, "ab") as log_file:
        # The child keeps its own copy of the descriptor; ours can close right away.
        return subprocess.Popen(
            list(argv), stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=dict(env) if env is not None else None,
            start_new_session=True, preexec_fn=_die_with_parent,
        )


def log_command(log_path: str | Path, argv: Sequence[str]) -> None:
    """Open a child's log with the command it runs (the log's first line, as a shell would echo it)."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log_file:
        log_file.write(f"$ {shlex.join(str(a) for a in argv)}\n".encode())


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def note_in_log(log_path: str | Path | None, message: str) -> None:
    """Append one line to a child's log (who stopped it and why)."""
    if log_path is None:
        return
    try:
        with open(log_path, "a") as handle:
            handle.write(f"[launcher pid {os.getpid()} {time.strftime('%H:%M:%S')}] {message}\n")
    except OSError:
        pass


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> int | None:
    """SIGTERM the child's process group, then SIGKILL after `timeout` seconds; reap it."""
    # The group is signalled even when the leader already exited: its children may live on.
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _signal_group(proc.pid, signal.SIGKILL)
        proc.wait(timeout=timeout)
    _signal_group(proc.pid, signal.SIGKILL)
    return proc.returncode


ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # terminal colours (the router's log has them)


def log_tail(log_path: str | Path | None, max_lines: int = 12) -> str:
    """The last `max_lines` non-empty lines of a log file, without terminal colour codes, or a note
    when there is none: enough to see why, short enough for an error message."""
    if log_path is None:
        return "(no log file)"
    try:
        data = Path(log_path).read_bytes()[-20000:]
    except OSError as err:
        return f"(cannot read {log_path}: {err})"
    lines = [line for line in ANSI_ESCAPE.sub("", data.decode("utf-8", errors="replace")).splitlines() if line.strip()]
    return "\n".join(line[:400] for line in lines[-max_lines:])


class ManagedProcesses:
    """Owns the child processes a launcher starts and stops all of them on exit.

    Use as a context manager; for signals, the caller installs
    `signal.signal(signal.SIGTERM, procs.handle_signal)` so that a killed job still cleans up.
    """

    def __init__(self, stop_timeout: float = 10.0):
        self.stop_timeout = stop_timeout
        self._owned: list[tuple[str, subprocess.Popen, Path]] = []

    def start(self, name: str, argv: Sequence[str], log_path: str | Path,
              env: Mapping[str, str] | None = None) -> subprocess.Popen:
        return self.adopt(name, start_process(argv, log_path, env), log_path)

    def adopt(self, name: str, proc, log_path: str | Path):
        """Own a child started another way (a Popen-like `proc` leading its own process group)."""
        self._owned.append((name, proc, Path(log_path)))
        return proc

    def stop(self, proc: subprocess.Popen, reason: str = "stopped by its owner") -> None:
        """Stop one owned process and forget it."""
        for name, owned, log_path in self._owned:
            if owned is proc:
                _stop_logged(name, proc, log_path, reason, self.stop_timeout)
        self._owned = [entry for entry in self._owned if entry[1] is not proc]

    def stop_all(self, reason: str = "the job is shutting down") -> None:
        """Stop every owned process: SIGTERM to all, newest first (the router before its workers), then
        wait for each. All at once, so a job's stop takes the slowest child's exit, not their sum (a
        stop signal leaves the job a few seconds: see rl_core.stop_signal.STOP_GRACE_S)."""
        owned, self._owned = self._owned[::-1], []
        for name, proc, log_path in owned:
            if proc.poll() is None:
                note_in_log(log_path, f"stopping {name} (SIGTERM to its process group): {reason}")
            _signal_group(proc.pid, signal.SIGTERM)
        for name, proc, log_path in owned:
            stop_process(proc, self.stop_timeout)  # already signalled: waits, SIGKILL after the timeout

    def exited(self) -> list[tuple[str, int, Path]]:
        """(name, exit code, log) of every owned process that is no longer running."""
        return [(name, proc.returncode, log_path) for name, proc, log_path in self._owned
                if proc.poll() is not None]

    def handle_signal(self, signum: int, frame=None) -> None:
        """Signal handler: stop everything, then exit as the signal would have."""
        self.stop_all(f"signal {signal.Signals(signum).name}")
        raise SystemExit(128 + signum)

    def __enter__(self) -> "ManagedProcesses":
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop_all()


def _stop_logged(name: str, proc: subprocess.Popen, log_path: Path, reason: str, timeout: float) -> None:
    if proc.poll() is None:
        note_in_log(log_path, f"stopping {name} (SIGTERM to its process group): {reason}")
    stop_process(proc, timeout)
