"""One run directory, one live job: rank 0 holds an exclusive lock on `<run_dir>/.job.lock`.

Two jobs writing one run directory (say a relaunch with `trainer.resume=auto` while the first
job still runs) would interleave metrics and overwrite each other's checkpoints. The lock is
an `fcntl.flock` held by rank 0 for the job's lifetime: the kernel releases it when the process
dies, however it dies, so a crashed job never blocks its own resume. The file also records who
holds it, for the error message of the job that is refused.
"""

from __future__ import annotations

import fcntl
import os
import socket
import sys
import time
from pathlib import Path

from rl_core.errors import JobError

LOCK_NAME = ".job.lock"


class RunDirInUse(JobError):
    """Another live job holds the run directory."""


class RunDirLock:
    def __init__(self, run_dir: str | Path, key: str = "trainer.run_dir"):
        self.run_dir = Path(run_dir)
        self.key = key
        self.path = self.run_dir / LOCK_NAME
        self._handle = None

    def acquire(self) -> "RunDirLock":
        # Owner-only when this job makes it: samples, evaluation answers and checkpoints are read by nobody else
        # (code a policy writes runs as another user, and must not find them).
        if not self.run_dir.exists():
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.run_dir.chmod(0o700)
        handle = open(self.path, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            owner = handle.read().strip() or "owner unknown"
            handle.close()
            raise RunDirInUse(f"{self.key}={self.run_dir} is in use by another live job ({owner}); wait for it "
                              f"to finish or stop it, or give this job its own {self.key}") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}: "
                     f"{' '.join(sys.argv[:3])} ...\n")
        handle.flush()
        self._handle = handle
        return self

    def release(self) -> None:
        if self._handle is not None:
            self._handle.close()  # closing the descriptor drops the lock
            self._handle = None
