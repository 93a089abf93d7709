"""The embedded engine started from a fork of its rank, with torch, transformers and its own code already imported.

Why: started as `python -m workers.engines.embedded`, every engine imports what its rank has just imported,
about 4 s of CPU each; on a small CPU machine the ranks' engines start together and take that many seconds
of every job's start-up (2 ranks on 2 cores: 3.7 of a 2-step job's 17 s).

The PPO entry point forks first thing (`rl_core/ppo/job.py:main`), before any set-up: a child forked after
OpenMP ran with several threads hangs in its first parallel op (the offline assets' builds and the trainer
run such ops), and it closes every descriptor it inherited, which would otherwise hold the rank's sockets
open. It waits for its command line (`start`, when the rank launches its engine), then runs the engine's
`main` exactly as the command would, in its own session with its output in its log; or it exits when its
rank closes it unused (an SGLang job) or exits (a failed start-up) or dies.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Mapping, Sequence

import setproctitle

from workers.procs import log_command, set_parent_death_signal

ENGINE_MODULE = "workers.engines.embedded"


class ForkedProcess:
    """A forked child as `subprocess.Popen` shows one to its owner (`pid`, `args`, `poll`, `wait`, `returncode`)."""

    def __init__(self, pid: int, args: Sequence[str]):
        self.pid, self.args, self.returncode = pid, list(args), None
        self._reaping = threading.Lock()  # the rollout thread polls it too (`dead_engines`)

    def poll(self) -> int | None:
        with self._reaping:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # reaped by someone else: its status is lost
                    pid, status = self.pid, None
                if pid:
                    self.returncode = -1 if status is None else os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        give_up_at = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if give_up_at is not None and time.monotonic() > give_up_at:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode


class EngineFork:
    """A child of this rank waiting to become its embedded engine: `start` it once, or `close` it."""

    def __init__(self, process: ForkedProcess, command_fd: int):
        self.process, self.command_fd = process, command_fd

    @classmethod
    def fork(cls) -> "EngineFork | None":
        """Fork now; call it from the main thread (the kernel's parent-death signal follows the forking thread).
        None off Linux, where the engine starts as its command (a fork of torch's process is Linux's to make)."""
        if not sys.platform.startswith("linux"):
            return None
        importlib.import_module(f"{ENGINE_MODULE}.__main__")  # the engine's own modules, imported once for both

        read_fd, write_fd = os.pipe()
        for stream in (sys.stdout, sys.stderr):  # what this process has buffered is not the child's to write
            stream.flush()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            os.close(write_fd)
            _child(parent, read_fd)  # never returns
        os.close(read_fd)
        return cls(ForkedProcess(pid, [sys.executable, "-m", ENGINE_MODULE]), write_fd)

    def start(self, argv: Sequence[str], log_path: str | Path, env: Mapping[str, str] | None = None) -> ForkedProcess:
        """Run the engine as `argv` (`build_engine_argv`'s command line) would, with `env` (default: this
        process's environment now, as a command would inherit it), its output appended to `log_path`."""
        if list(argv[1:3]) != ["-m", ENGINE_MODULE]:
            raise ValueError(f"an engine fork runs `python -m {ENGINE_MODULE}`, not {list(argv[:3])}")
        log_command(log_path, argv)
        command = json.dumps({"args": list(argv[3:]), "log": str(log_path),
                              "env": dict(env) if env is not None else dict(os.environ)}).encode()
        self._send(command)
        self.process.args = list(argv)
        return self.process

    def close(self) -> None:
        """If never started: the child reads nothing and exits, reaped here (a started one is its owner's)."""
        if self.command_fd >= 0:
            self._send(b"")
            try:
                self.process.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def _send(self, data: bytes) -> None:
        fd, self.command_fd = self.command_fd, -1
        if fd < 0:
            raise RuntimeError("this engine fork was started or closed already")
        try:
            with os.fdopen(fd, "wb") as pipe:
                pipe.write(data)
        except BrokenPipeError:  # the child is gone (killed): its exit code says so to whoever polls it
            pass


def _child(parent: int, read_fd: int) -> None:
    """In the fork: a session of its own (the rank stops its engine by process group), gone with its rank,
    none of the rank's signal handlers, exit functions or open files; then the engine, or nothing."""
    code = 1
    try:
        os.setsid()
        set_parent_death_signal(signal.SIGTERM)
        if os.getppid() != parent:  # the rank died before the line above
            os._exit(0)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):  # as a new Python has them
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        atexit._clear()  # the rank's exit functions are not the engine's (a new Python has none)
        os.closerange(3, read_fd)
        os.closerange(read_fd + 1, os.sysconf("SC_OPEN_MAX"))
        with os.fdopen(read_fd, "rb") as pipe:
            data = pipe.read()
        if not data:
            os._exit(0)
        command = json.loads(data)
        log = os.open(command["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        sys.argv = [sys.executable, "-m", ENGINE_MODULE, *command["args"]]
        # `ps` and /proc show the engine's command, not its rank's (before the environment changes: the title
        # takes the memory of the original one)
        setproctitle.setproctitle(shlex.join(sys.argv))
        os.environ.clear()
        os.environ.update(command["env"])
        from workers.engines.embedded.__main__ import main

        main(command["args"])  # ends the process itself once served (exit_now)
        code = 0
    except SystemExit as end:
        code = end.code if isinstance(end.code, int) else int(end.code is not None)  # as Python's exit reads it
    except BaseException:  # noqa: BLE001 - said in the engine's log, then the exit code says it failed
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
