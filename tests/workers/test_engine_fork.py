"""The embedded engine forked from its rank (workers/engines/embedded/forked.py): it serves as the command
would, holds none of the rank's descriptors, stops with its process group, and leaves nothing when unused or
when its rank dies. Each case runs a stand-in rank in a fresh process (tests/workers/fork_rank.py): a fork of
this test process, which has run multi-threaded ops already, is what the module must never do."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.ppo.test_job import REPO
from tests.ppo.test_reliability import _proc_stat


def rank(mode: str, model_dir: str, log_dir: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # as torchrun sets it
    return subprocess.Popen([sys.executable, "-m", "tests.workers.fork_rank", mode, model_dir, str(log_dir)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)


def rank_result(mode: str, model_dir: str, log_dir: Path, timeout_s: float) -> dict:
    """The stand-in rank's JSON line once it exited 0; on a timeout or failure its session is killed (no orphan)."""
    proc = rank(mode, model_dir, log_dir)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out
    return json.loads(out.strip().splitlines()[-1])


def gone(pid: int, within_s: float = 10.0) -> bool:
    """Whether `pid` has exited (a zombie counts: only its dying parent's reaping is left) within `within_s`."""
    give_up_at = time.monotonic() + within_s
    while _proc_stat(pid) is not None:
        if time.monotonic() > give_up_at:
            return False
        time.sleep(0.1)
    return True


def test_a_forked_engine_answers_as_the_command_started_one_and_stops_with_its_process_group(tiny_model_dir, tmp_path):
    seen = rank_result("serve", tiny_model_dir, tmp_path, timeout_s=300)
    # Greedy tokens: the same model, the same engine code, whether forked or started as a command.
    assert seen["answers"]["forked"] == seen["answers"]["command"]
    assert len(seen["answers"]["forked"]) == 8
    assert seen["code"] is not None and gone(seen["fork_pid"])  # stopped by SIGTERM to its group, and reaped
    forked_log = Path(seen["logs"]["forked"]).read_text()
    assert forked_log.startswith("$ ") and "-m workers.engines.embedded" in forked_log.splitlines()[0]
    assert '"POST /generate HTTP/1.1" 200' in forked_log  # the engine's own logging, not the rank's
    # What `ps` shows, and what tests and people find an engine by: its command, not its rank's.
    assert "-m workers.engines.embedded " in seen["cmdline"] and f"--port {seen['port']} " in seen["cmdline"]


def test_a_fork_closed_unused_exits_at_once_and_one_whose_rank_dies_goes_with_it(tiny_model_dir, tmp_path):
    seen = rank_result("close", tiny_model_dir, tmp_path, timeout_s=120)
    assert seen["code"] == 0 and gone(seen["fork_pid"], 1.0)

    proc = rank("die", tiny_model_dir, tmp_path)
    try:
        fork_pid = json.loads(proc.stdout.readline())["fork_pid"]
        assert not gone(fork_pid, 0.5)  # waiting for its command line
        os.killpg(proc.pid, signal.SIGKILL)  # the rank only: the fork leads a session of its own
        proc.wait(timeout=30)
        assert gone(fork_pid), "the fork outlived its rank"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
