"""How a job ends: one line for every failure and stop, the same line in torchrun's error file."""

import json
import os
import signal
import time

import pytest

from rl_core.cli import run_main
from rl_core.errors import JobError, PeerFailed

# pytest captures stderr, so torch's `record` cannot enable faulthandler on it; harmless here.
pytestmark = pytest.mark.filterwarnings("ignore:Unable to enable fault handler")


@pytest.fixture
def error_file(tmp_path, monkeypatch):
    """torchrun's per-rank error file, and the signal handlers run_main replaces, restored afterwards."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    monkeypatch.setenv("RANK", "0")
    yield path
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def recorded(path) -> tuple[str, int]:
    """(the line torchrun's summary will show, its timestamp)."""
    message = json.loads(path.read_text())["message"]
    return message["extraInfo"]["py_callstack"], int(message["extraInfo"]["timestamp"])


def ends(main, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as stopped:
        run_main(lambda argv, progress: main(), [], stop_grace_s=None)  # no watchdog in pytest's own process
    return stopped.value.code, capsys.readouterr().err


def test_a_user_error_is_one_line_without_traceback(error_file, capsys):
    def main():
        raise JobError("model.path=/x does not exist; fix the path")

    code, err = ends(main, capsys)
    assert code == 1
    assert err == "[rank 0] error: model.path=/x does not exist; fix the path\n"
    assert recorded(error_file)[0] == "[rank 0] error: model.path=/x does not exist; fix the path"


def test_a_bug_keeps_its_traceback_and_ends_with_the_line(error_file, capsys):
    def main():
        raise KeyError("boom")

    code, err = ends(main, capsys)
    assert code == 1 and "Traceback (most recent call last)" in err
    assert err.rstrip().splitlines()[-1] == "[rank 0] error: KeyError: 'boom'"


def test_a_rank_stopped_by_a_failed_peer_stays_quiet_and_never_hides_the_cause(error_file, capsys):
    def main():
        raise PeerFailed("rank 0 failed: bad data")

    code, err = ends(main, capsys)
    assert code == 1 and err == ""
    line, stamp = recorded(error_file)
    assert line == "[rank 0] stopped: rank 0 failed: bad data"
    assert stamp > time.time() + 30  # later than any real cause, so torchrun names that one the root cause


def test_a_collective_broken_by_a_dead_peer_is_one_line(error_file, capsys):
    def main():
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:3814")

    code, err = ends(main, capsys)
    assert code == 1 and "Traceback" not in err
    assert err.startswith("[rank 0] stopped: another rank failed or exited first (") and err.count("\n") == 1


def test_a_peer_lost_while_a_checkpoint_is_written_is_named_with_its_node(error_file, capsys, monkeypatch):
    from torch.distributed.checkpoint.api import CheckpointException

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")

    def main():
        raise CheckpointException("save failed", {3: (SystemExit(143), None)})

    code, err = ends(main, capsys)
    assert code == 1 and err.count("\n") == 1
    assert err.startswith("[rank 0] stopped: rank 3 (node 1) failed while the checkpoint was written (SystemExit: 143)")


def test_an_engine_call_that_met_a_reset_connection_is_this_ranks_error_in_full(error_file, capsys):
    def main():
        raise RuntimeError("engine http://127.0.0.1:5 failed during the weight push of version 2: "
                           "http://127.0.0.1:5/resume_memory_occupation: no HTTP answer: ClientOSError: [Errno 104] "
                           "Connection reset by peer; its log: /runs/x/logs/engine-rank1.log")

    code, err = ends(main, capsys)
    assert code == 1 and err.splitlines()[-1].startswith("[rank 0] error: RuntimeError: engine http://127.0.0.1:5")
    assert err.splitlines()[-1].endswith("its log: /runs/x/logs/engine-rank1.log")


def test_a_peer_lost_on_another_host_is_named_by_its_address(error_file, capsys):
    def main():
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.9.0.2]:41150")

    code, err = ends(main, capsys)
    assert code == 1 and err.startswith("[rank 0] stopped: the rank at 10.9.0.2 went away") and err.count("\n") == 1


def test_ctrl_c_is_one_line_and_a_second_one_does_not_cut_the_clean_up_short(error_file, capsys):
    cleaned = []

    def main():
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # interrupted by the handler's SystemExit
        finally:
            os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C during the clean-up
            time.sleep(0.1)
            cleaned.append(True)

    code, err = ends(main, capsys)
    assert code == 128 + signal.SIGINT and cleaned == [True]
    assert err == "[rank 0] stopped by SIGINT during start-up\n"
    assert "KeyboardInterrupt" not in err


FOLLOWER = """
from rl_core.cli import run_main
from rl_core.errors import PeerFailed

def main(argv, progress):
    print("failing", flush=True)
    raise PeerFailed("rank 0 failed: bad data")

run_main(main, [], stop_grace_s=2.0)
"""


@pytest.mark.timeout(60)
def test_a_rank_that_follows_a_failed_peer_exits_only_after_it(tmp_path):
    """A rank told that rank 0 failed stays until torchrun's SIGTERM (sent once rank 0 has exited), so rank 0 is
    never stopped before it says why; then it ends with its own status, quietly."""
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2", "PYTHONPATH": repo,
           "TORCHELASTIC_ERROR_FILE": str(tmp_path / "error.json")}
    proc = subprocess.Popen([sys.executable, "-c", FOLLOWER], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)
    try:
        assert proc.stdout.readline() == "failing\n"
        time.sleep(3.0)  # longer than the stop grace: the wait is not a stop
        assert proc.poll() is None, "it exited before the failed rank"
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)  # torchrun's, once rank 0 is gone
        code = proc.wait(timeout=20)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert code == 1 and proc.stderr.read() == "" and took < 10.0, took  # the signal ended the wait, not its 30 s
    assert recorded(tmp_path / "error.json")[0] == "[rank 1] stopped: rank 0 failed: bad data"


HANGING_CLEAN_UP = """
import subprocess, sys, threading
from rl_core.cli import run_main

def main(argv, progress):
    child = subprocess.Popen(["sleep", "120"], start_new_session=True)  # an engine, say: its own process group
    progress.at(7, "update")
    try:
        print(child.pid, flush=True)  # in the step: the test's signal cannot land before it
        threading.Event().wait()  # the step, interrupted by the signal
    finally:
        threading.Event().wait()  # a clean-up that never ends (a later signal is only noted)

run_main(main, [], stop_hint="resume hint", children="engines and router", stop_grace_s=2.0)
"""


@pytest.mark.timeout(60)
def test_a_clean_up_that_hangs_after_a_stop_signal_is_cut_short_by_the_watchdog(tmp_path):
    """The watchdog, not the main thread, ends a rank whose clean-up never returns: within the grace, with
    one line, 128 + the signal as exit code, and the children it started killed."""
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "RANK": "0", "PYTHONPATH": repo, "TORCHELASTIC_ERROR_FILE": str(tmp_path / "error.json")}
    proc = subprocess.Popen([sys.executable, "-c", HANGING_CLEAN_UP], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)
    try:
        child = int(proc.stdout.readline())
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)  # torchrun's follow-up must not change the outcome
        code = proc.wait(timeout=20)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    err = proc.stderr.read()
    line = ("[rank 0] stopped by SIGTERM at step 7 (update); its clean-up took over 2 s, so engines and router were "
            "killed; resume hint")
    assert code == 128 + signal.SIGTERM and err == line + "\n", err
    assert 2.0 <= took < 10.0, took  # the grace, then the watchdog (a busy machine may delay it; never the 20 s wait)
    assert recorded(tmp_path / "error.json")[0] == line
    time.sleep(0.2)
    assert not os.path.exists(f"/proc/{child}") or " Z " in open(f"/proc/{child}/stat").read(), "the child outlived it"
