"""The PPO job against real SGLang servers on CPU, next to the same job on embedded engines.

2 ranks, 2 sync steps and 2 async steps (a third repeats the second's calls: sync releases and resumes every
step; async without partial rollout pushes into an idle engine, and step 2 already trains on a batch one version
stale). The embedded side is the shared sync and async runs (tests/ppo/conftest.py: the same settings, more
steps), so only the SGLang job launches here. Each rank's engine must receive the same control calls in the same
order as in those runs' first 2 steps (read from the engines' own logs), report the pushed weights (probe gap
within tolerance), and leave nothing running, also when an engine is killed mid-run.

The killed engine is a 1-rank job's: one SGLang server start instead of two (most of the case's time on
2 cores). What is SGLang's own there (its server and its scheduler and detokenizer children dying, being
named, leaving nothing) is the same from one rank; a peer rank stopping when another rank's engine dies
is the embedded engine's test (tests/ppo/test_job.py, test_dead_engine_stops_the_job_with_its_name_and_log).
"""

import math
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.jobs import read_metrics
from tests.ppo.test_job import run_job, torchrun_argv, wait_gone
from tests.sglang_env import CONTROL_PATHS, engine_calls, require_sglang_python

# 2 steps with what decides the engine calls set as in the shared runs (tests/ppo/conftest.py), which train on;
# sync releases every step: SGLang's release/resume is what the comparison is for.
MODES = {"sync": ["trainer.total_episodes=16", "rollout.release_memory=always"],
         "async": ["trainer.total_episodes=16", "trainer.mode=async", "async.max_staleness=1", "async.queue_batches=2",
                   "async.partial_rollout=false"]}


def sglang_overrides() -> list[str]:
    return ["rollout.engine=sglang", f"rollout.sglang_python={require_sglang_python()}"]


def sglang_processes() -> list[int]:
    """SGLang's own helpers (scheduler, detokenizer) name themselves `sglang::...`, not by model path."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "cmdline").read_bytes().startswith(b"sglang::"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def control_calls(run_dir: Path, rank: int) -> list[tuple[str, str, int]]:
    return engine_calls((run_dir / "logs" / f"engine-rank{rank}.log").read_text(), CONTROL_PATHS)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", list(MODES))
def test_the_job_makes_the_same_engine_calls_against_sglang_as_against_the_embedded_engine(small_job, request,
                                                                                           tmp_path, mode):
    embedded_dir = request.getfixturevalue(f"{mode}_run")[0]  # the shared run of this mode
    before = set(sglang_processes())
    run_job(small_job, tmp_path / "sglang", *MODES[mode], *sglang_overrides(), timeout=800)
    sglang = read_metrics(tmp_path / "sglang")
    assert [m["step"] for m in sglang] == [1, 2] and len(read_metrics(embedded_dir)) > 2
    assert all(math.isfinite(m["reward/score_mean"]) for m in sglang)
    assert all(0 <= m["weight_sync/probe_gap"] < 1e-3 for m in sglang)  # float32 on both sides
    for rank in (0, 1):
        calls = control_calls(tmp_path / "sglang", rank)
        # The first 2 steps' calls of the longer run, in order: the push at the start and one after each step.
        assert calls == control_calls(embedded_dir, rank)[:len(calls)]
        assert [path for _, path, _ in calls].count("/end_weight_update") == 3
        assert all(status == 200 for _, _, status in calls)
    assert wait_gone(str(small_job["root"])) == []
    assert set(sglang_processes()) - before == set()


@pytest.mark.timeout(900)
def test_a_killed_sglang_engine_stops_the_job_with_its_name_and_leaves_nothing(small_job, tmp_path):
    run_dir = tmp_path / "killed"
    before = set(sglang_processes())
    overrides = small_job["overrides"] + sglang_overrides() + [f"trainer.run_dir={run_dir}",
                                                               "trainer.total_episodes=4000"]
    proc = subprocess.Popen(torchrun_argv(overrides, ranks=1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.is_file() and metrics.read_text().strip()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-4000:]
            time.sleep(1)
        engine_log = run_dir / "logs" / "engine-rank0.log"
        port = engine_log.read_text().split("--port ", 1)[1].split()[0]
        server = next(int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
                      and f"--port {port}" in (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        os.kill(server, signal.SIGKILL)
        output, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode != 0
    assert f":{port}" in output and "engine-rank0.log" in output, output[-4000:]
    assert wait_gone(str(small_job["root"]), seconds=30) == []
    assert set(sglang_processes()) - before == set()
