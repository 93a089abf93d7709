"""How the PPO job ends: killed launcher, stuck env, Ctrl-C and resume, a second job on a live run
directory, bad model or data paths. torchrun with 2 ranks on gloo, real engines and router, small settings.

Leftover processes are found by following torchrun's process tree while the job runs (ranks,
engines, router and torch's shm managers): the router renames itself (setproctitle), so its
command line cannot be matched, and orphans are re-parented, so the tree cannot be read after.
"""

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.jobs import output_lines, read_metrics
from tests.ppo.test_job import torchrun_argv


# A traceback through the framework's own code (torchrun's own frames are torch's business).
OUR_TRACEBACK = re.compile(r'File "[^"]*/(rl_core|workers|envs)/')


def _proc_stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of a live process, or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
    if fields[0] == "Z":  # a zombie has exited; its parent just has not reaped it yet
        return None
    return int(fields[1]), int(fields[19])


class ProcessTree:
    """Every process that descends from `root` while the job runs, remembered with its start time."""

    def __init__(self, root: int):
        self.root = root
        self.seen: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.scan()
            time.sleep(0.2)

    def scan(self) -> None:
        stats = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                stat = _proc_stat(int(entry.name))
                if stat is not None:
                    stats[int(entry.name)] = stat
        family = {self.root} | set(self.seen)
        grew = True
        while grew:
            grew = False
            for pid, (ppid, _) in stats.items():
                if ppid in family and pid not in family:
                    family.add(pid)
                    grew = True
        for pid in family - {self.root}:
            if pid in stats and pid not in self.seen:
                self.seen[pid] = stats[pid][1]

    def stop_watching(self) -> None:
        self.scan()
        self._stop.set()
        self._thread.join()

    def alive(self) -> list[str]:
        """Command lines of remembered processes still running (same pid and start time)."""
        left = []
        for pid, started in self.seen.items():
            stat = _proc_stat(pid)
            if stat is not None and stat[1] == started:
                try:
                    left.append(f"{pid}: {Path(f'/proc/{pid}/cmdline').read_bytes()[:120]!r}")
                except OSError:
                    pass
        return left

    def wait_all_gone(self, seconds: float) -> float:
        """Seconds until no remembered process is left (fails the test after `seconds`)."""
        started = time.monotonic()
        while self.alive():
            if time.monotonic() - started > seconds:
                pytest.fail(f"processes of the job still alive after {seconds}s: {self.alive()}")
            time.sleep(0.2)
        return time.monotonic() - started

    def kill_all(self) -> None:
        for pid, started in self.seen.items():
            stat = _proc_stat(pid)
            if stat is not None and stat[1] == started:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass


class Job:
    """torchrun in its own session, its output lines timestamped as they arrive."""

    def __init__(self, small_job, run_dir: Path, *extra: str, config: str = "ppo_sentiment.yaml",
                 env: dict | None = None, module: str = "rl_core.train"):
        overrides = small_job["overrides"] + [f"trainer.run_dir={run_dir}", *extra]
        argv = [module if arg == "rl_core.train" else arg for arg in torchrun_argv(overrides, config)]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=None if env is None else {**os.environ, **env})
        self.tree = ProcessTree(self.proc.pid)
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in output_lines(self.proc):
            self.lines.append((time.monotonic(), line))

    @property
    def output(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def first_line_with(self, text: str) -> tuple[float, str]:
        found = next(((at, line) for at, line in self.lines if text in line), None)
        if found is None:
            pytest.fail(f"no line {text!r} in the job's output (exit {self.proc.poll()}):\n{self.output[-6000:]}")
        return found

    def wait_for_line(self, text: str, timeout: float) -> float:
        """When the first line with `text` arrived (fails the test if the job ends or time runs out first)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = next((at for at, line in list(self.lines) if text in line), None)
            if found is not None:
                return found
            if self.proc.poll() is not None:
                time.sleep(0.5)  # the reader's last lines
                pytest.fail(f"the job ended before printing {text!r}:\n{self.output[-4000:]}")
            time.sleep(0.05)
        pytest.fail(f"no line {text!r} within {timeout}s:\n{self.output[-4000:]}")

    def wait(self, timeout: float) -> int:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.abort()
            pytest.fail(f"the job did not end within {timeout}s:\n{self.output[-4000:]}")
        self._reader.join(timeout=10)
        self.tree.stop_watching()
        return self.proc.returncode

    def abort(self) -> None:
        """Test clean-up: SIGKILL torchrun's group and everything the job started."""
        self.tree.scan()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        self.tree.kill_all()


def wait_for_step(run_dir: Path, job: Job, step: int, timeout: float = 400) -> None:
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if job.proc.poll() is not None:
            pytest.fail(f"the job ended before step {step}:\n{job.output[-4000:]}")
        if metrics.is_file() and any(json.loads(line)["step"] >= step for line in metrics.read_text().splitlines()
                                     if line.strip()):
            return
        time.sleep(0.2)
    pytest.fail(f"no step {step} within {timeout}s")


@pytest.mark.timeout(600)
def test_kill9_of_torchrun_leaves_nothing_and_a_second_job_on_a_live_run_dir_is_refused(small_job, tmp_path):
    run_dir = tmp_path / "run"
    job = Job(small_job, run_dir, "trainer.total_episodes=4000", "trainer.save_every=1")
    try:
        wait_for_step(run_dir, job, 1)

        # A second job on the same run directory stops at once with one line naming the key.
        second = Job(small_job, run_dir, "trainer.total_episodes=4000", "trainer.resume=auto")
        started = time.monotonic()
        assert second.wait(180) != 0
        refused_after = time.monotonic() - started
        line = second.first_line_with("is in use by another live job")[1]
        assert line.startswith(f"[rank 0] error: trainer.run_dir={run_dir} is in use by another live job (pid ")
        holder = int(re.search(r"\(pid (\d+) on", line).group(1))
        assert holder in job.tree.seen  # names the rank that holds it
        assert f"traceback : {line}" in second.output  # torchrun's summary shows the same line
        assert not OUR_TRACEBACK.search(second.output), second.output[-3000:]
        assert job.proc.poll() is None, "the refused job must not disturb the running one"

        job.tree.scan()
        killed = time.monotonic()
        os.killpg(job.proc.pid, signal.SIGKILL)  # torchrun and its process group; the ranks have their own
        gone_after = job.tree.wait_all_gone(30)
        job.wait(30)
        print(f"\nsecond job refused after {refused_after:.1f}s: {line}\n"
              f"kill -9 of torchrun's group: all {len(job.tree.seen)} processes gone after "
              f"{gone_after:.1f}s (kill at {killed:.0f})")
    finally:
        job.abort()

    # The dead job's lock does not block a resume, and each step is logged exactly once.
    done = max(m["step"] for m in read_metrics(run_dir))
    resumed = Job(small_job, run_dir, f"trainer.total_episodes={8 * (done + 1)}", "trainer.save_every=1",
                  "trainer.resume=auto")
    try:
        assert resumed.wait(400) == 0, resumed.output[-4000:]
        resumed.tree.wait_all_gone(10)  # (torch's shared-memory manager lives 2 s past its last client)
    finally:
        resumed.abort()
    assert [m["step"] for m in read_metrics(run_dir)] == list(range(1, done + 2))


@pytest.mark.timeout(600)
def test_a_never_returning_sync_env_stops_every_rank_promptly(small_job, tmp_path):
    job = Job(small_job, tmp_path / "stuck", "trainer.total_episodes=4000", "env.step_timeout_s=2",
              "env.cls=tests.ppo.hanging_env:NeverReturningEnv", "env.thread_pool_size=2")
    try:
        code = job.wait(400)
        failed_at, line = job.first_line_with("trajectories failed in their environment")
        ended = time.monotonic()
        gone_after = job.tree.wait_all_gone(30)
    finally:
        job.abort()
    assert code != 0
    assert line.startswith("[rank 0] error: 8 of 8 trajectories failed in their environment") and \
        "env.step_timeout_s" in line and "env.max_failed_ratio" in line, line
    assert f"traceback : {line}" in job.output  # the root cause in torchrun's summary
    exit_s = ended - failed_at
    print(f"\nstuck env: '{line}'; every rank exited {exit_s:.1f}s after it, last process gone "
          f"{gone_after:.1f}s after torchrun")
    assert exit_s < 60, job.output[-3000:]  # today: rank 0 never exits, rank 1 waits 600 s


@pytest.mark.timeout(900)
def test_ctrl_c_stops_with_one_line_and_resume_logs_every_step_once_keeping_the_last_checkpoints(small_job,
                                                                                                 tmp_path):
    run_dir = tmp_path / "interrupted"
    common = ["trainer.total_episodes=40", "trainer.save_every=1", "trainer.keep_last=2"]
    job = Job(small_job, run_dir, *common)
    try:
        wait_for_step(run_dir, job, 3)
        interrupted = time.monotonic()
        os.killpg(job.proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends to the foreground group
        code = job.wait(120)
        exit_s = time.monotonic() - interrupted
        gone_after = job.tree.wait_all_gone(30)
    finally:
        job.abort()
    assert code != 0
    stopped = [line for _, line in job.lines if "stopped by SIGINT" in line]
    assert len(stopped) == 1 and re.fullmatch(r"\[rank 0\] stopped by SIGINT at step [34] \([a-z ]+\); .*engines and router "
                                              r"were (shut down|killed); trainer.resume=auto continues from the last "
                                              r"checkpoint",
                                              stopped[0]), job.output[-4000:]
    # No KeyboardInterrupt or gloo traceback from a rank (torchrun prints its own SignalException).
    assert "KeyboardInterrupt" not in job.output and "gloo" not in job.output, job.output[-4000:]
    ours = OUR_TRACEBACK.search(job.output)
    assert not ours, job.output[max(0, ours.start() - 3000):ours.end() + 1500]  # the traceback, from its start
    print(f"\nCtrl-C: '{stopped[0]}'; torchrun exited {exit_s:.1f}s after the signal, every process gone "
          f"{gone_after:.1f}s later")

    resumed = Job(small_job, run_dir, *common, "trainer.resume=auto")
    try:
        assert resumed.wait(400) == 0, resumed.output[-4000:]
    finally:
        resumed.abort()
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3, 4, 5]  # each step once, none missing
    samples = [json.loads(line)["step"] for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples == sorted(samples)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000004", "step_00000005"]


def _bad_prompts(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"text": "the old man walked to the market."}\n{"text": "she smiled\n')
    return path


def _latin1_prompts(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b'{"text": "the old man walked to the market."}\n{"text": "caf\xe9 au lait."}\n')
    return path


def _long_prompts(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"text": "she smiled."}\n{"text": "' + "the old man walked to the market. " * 8 + '"}\n')
    return path


# A directory that is not a model, a file, a hub name: tests/workers/test_model_paths.py (no job needed).
BAD_INPUTS = {
    "missing model": (lambda tmp: "model.path=/nonexistent/model",
                      "[rank 0] error: model.path=/nonexistent/model does not exist"),
    "malformed data": (lambda tmp: f"data.train_path={_bad_prompts(tmp)}",
                       "[rank 0] error: {tmp}/prompts.jsonl, line 2: invalid JSON"),
    "data not UTF-8": (lambda tmp: f"data.train_path={_latin1_prompts(tmp)}",
                       "[rank 0] error: {tmp}/prompts.jsonl, line 2: byte 0xe9 at column 14 is not UTF-8"),
    "long prompt refused": (lambda tmp: f"data.train_path={_long_prompts(tmp)} data.on_long_prompt=error",
                            "[rank 0] error: {tmp}/prompts.jsonl, row 2: the prompt has"),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_model_or_data_paths_stop_before_any_engine_with_one_line(small_job, tmp_path, case):
    make_override, expected = BAD_INPUTS[case]
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    run_dir = tmp_path / "run"
    job = Job(small_job, run_dir, "trainer.total_episodes=16", *make_override(inputs).split())
    started = time.monotonic()
    try:
        code = job.wait(240)
    finally:
        job.abort()
    seconds = time.monotonic() - started
    expected = expected.format(tmp=inputs)
    lines = [line for _, line in job.lines if line.startswith(expected)]
    assert code != 0 and lines, job.output[-4000:]
    assert f"traceback : {lines[0]}" in job.output  # torchrun's summary shows the line, not a traceback
    assert not OUR_TRACEBACK.search(job.output), job.output[-4000:]
    if case == "malformed data":
        assert "data.on_malformed=skip" in lines[0]
    assert not (run_dir / "logs" / "engine-rank0.log").exists(), "an engine started before the check"
    print(f"\n{case}: '{lines[0]}' after {seconds:.1f}s")


@pytest.mark.timeout(300)
def test_resuming_a_finished_run_says_so_and_exits_before_any_engine(small_job, tmp_path):
    # A run that ended: its last checkpoint is at the final step (16 episodes / batch 8) and final/ holds
    # its model. Only the checkpoint's trainer_state.json is read, so a stand-in is enough.
    run_dir = tmp_path / "finished"
    checkpoint = run_dir / "checkpoints" / "step_00000002"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text('{"step": 2}')
    (run_dir / "final").mkdir()
    (run_dir / "final" / "config.json").write_text("{}")
    job = Job(small_job, run_dir, "trainer.total_episodes=16", "trainer.resume=auto")
    try:
        code = job.wait(240)
    finally:
        job.abort()
    lines = [line for _, line in job.lines if "nothing left to train" in line]
    assert code == 0 and len(lines) == 1, job.output[-4000:]
    assert lines[0].startswith(f"nothing left to train: {checkpoint} is at step 2, the last one"), lines[0]
    assert not (run_dir / "logs" / "engine-rank0.log").exists(), "an engine started"
    assert (run_dir / "final" / "config.json").read_text() == "{}"  # final/ is not rewritten
    print(f"\n'{lines[0]}'")


@pytest.mark.timeout(600)
def test_a_dead_router_is_named_with_its_log(small_job, tmp_path):
    run_dir = tmp_path / "router"
    job = Job(small_job, run_dir, "trainer.total_episodes=4000")
    try:
        wait_for_step(run_dir, job, 1)
        job.tree.scan()
        router = [pid for pid in job.tree.seen if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"sglang::router")]
        assert len(router) == 1, job.tree.alive()
        os.kill(router[0], signal.SIGKILL)
        killed = time.monotonic()
        code = job.wait(300)
        exit_s = time.monotonic() - killed
        job.tree.wait_all_gone(30)
    finally:
        job.abort()
    url = json.loads((run_dir / "logs" / "engines.json").read_text())["router"]
    line = job.first_line_with("rollout failed")[1]
    assert code != 0 and line.startswith(f"[rank 0] error: rollout failed: sglang-router {url} exited with code -9 "
                                         f"(log {run_dir / 'logs' / 'router.log'})"), line
    assert f"traceback : {line}" in job.output
    print(f"\ndead router: '{line}' after {exit_s:.1f}s")
