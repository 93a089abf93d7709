"""One run directory, one live job: a second job is refused in one line; a dead job's lock is no obstacle."""

import os
import signal
import subprocess
import sys
import time

import pytest

from rl_core.run_dir import LOCK_NAME, RunDirInUse, RunDirLock

HOLD = """
import sys, time
from rl_core.run_dir import RunDirLock
lock = RunDirLock(sys.argv[1]).acquire()  # held while the object lives
print("held", flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(60)
def test_a_live_holder_refuses_others_and_its_death_frees_the_directory(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirInUse) as refused:
            RunDirLock(tmp_path).acquire()
        message = str(refused.value)
        assert message.startswith(f"trainer.run_dir={tmp_path} is in use by another live job (pid {holder.pid} ")
        assert "give this job its own trainer.run_dir" in message
        os.kill(holder.pid, signal.SIGKILL)  # a crash: nothing is cleaned up, the lock file stays
        holder.wait(10)
    finally:
        if holder.poll() is None:
            holder.kill()
    assert (tmp_path / LOCK_NAME).is_file()
    started = time.monotonic()
    lock = RunDirLock(tmp_path).acquire()  # the kernel released the dead holder's lock
    assert time.monotonic() - started < 1
    assert f"pid {os.getpid()} " in (tmp_path / LOCK_NAME).read_text()
    lock.release()
    RunDirLock(tmp_path).acquire().release()


def test_a_new_run_directory_is_owner_only(tmp_path):
    run_dir = tmp_path / "runs" / "job"
    lock = RunDirLock(run_dir).acquire()
    try:
        (run_dir / "eval_samples.jsonl").write_text('{"answer": "#### 13"}\n')
        assert (run_dir.stat().st_mode & 0o777) == 0o700
        if os.geteuid() == 0:  # another user (as the sandbox's code runs) cannot read what is inside
            os.chmod(tmp_path, 0o755)
            os.chmod(tmp_path / "runs", 0o755)
            read = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "cat",
                                   str(run_dir / "eval_samples.jsonl")], capture_output=True, text=True)
            assert read.returncode != 0 and "Permission denied" in read.stderr
    finally:
        lock.release()
    existing = tmp_path / "shared"
    existing.mkdir(mode=0o755)
    RunDirLock(existing).acquire().release()
    assert (existing.stat().st_mode & 0o777) == 0o755  # a directory the user made keeps its mode
