"""Running a job through torchrun from a test."""

import os
import signal
import subprocess

import pytest


def run_to_end(argv: list[str], timeout: float, cwd=None) -> str:
    """Run `argv` in its own session (a timeout kills torchrun *and* its ranks: no orphans left for
    later tests); return its output, failing the test with the output's tail unless it exits 0."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            cwd=cwd)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"the job did not finish within {timeout}s:\n{output[-5000:]}")
    assert proc.returncode == 0, output[-6000:]
    return output
