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
