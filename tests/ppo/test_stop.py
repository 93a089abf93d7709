"""A stop signal at any moment of a PPO step (issue 35): every rank, engine and router gone within 10 s,
one `stopped by SIG... at step N (phase)` line, and the run directory resumable.

The arithmetic GRPO recipe (reward functions in worker processes, evaluation) on 2 CPU ranks with gloo,
real engines and router, small batches. One run is stopped in each phase of step 2 in turn and the
next one resumes it with `trainer.resume=auto`; a last run trains to the end. Signals land in a phase
by waiting: rollouts and evaluations are made slow by the env (`tests/ppo/slow_env.py`); for the
other phases one rank holds at the start of the phase (`RL_CORE_TEST_HOLD`, rl_core/stop_signal.py) while the
other goes on into it, where it waits for the holding rank inside a collective: the case Python's
signal handlers alone cannot end (today's failure: 30 s, then torchrun's SIGKILL, no line).
"""

import json
import os
import re
import signal
import time

import pytest

from rl_core.stop_signal import TEST_HOLD_ENV
from tests.ppo.test_reliability import OUR_TRACEBACK, Job
from tests.jobs import read_metrics

STOP_WITHIN_S = 10.0
HINT = "trainer.resume=auto continues from the last checkpoint"

# The job: the arithmetic recipe, small batches; a checkpoint every step, an evaluation at step 2.
ARITHMETIC = {"overrides": [
    "algorithm.batch_size=16", "algorithm.group_size=4", "env.num_envs=8", "eval.max_prompts=12",
    "trainer.progress=false", "trainer.save_every=1", "eval.every=2",
    "env.cls=tests.ppo.slow_env:SlowSingleTurnEnv", "env.kwargs.delay_s=1.0"]}
RUN_STEPS = "trainer.total_episodes=48"  # 3 steps
# A run whose signal lands by a hold, and the last run, need no slow env: without it their rollouts and
# evaluations take no waiting (2 s each at 1 s a step: 16 episodes or 12 prompts over 8 envs).
FAST_ENV = "env.kwargs.delay_s=0.0"


def stop(job: Job, sig: signal.Signals, at: float) -> tuple[float, float]:
    """Send `sig` to torchrun at `at` (monotonic); (seconds until torchrun exited, until every process was gone)."""
    time.sleep(max(0.0, at - time.monotonic()))
    job.tree.scan()
    sent = time.monotonic()
    os.kill(job.proc.pid, sig)  # what a scheduler sends before preempting the job (torchrun passes it on)
    code = job.wait(60)
    exited = time.monotonic() - sent
    assert code != 0
    gone = exited + job.tree.wait_all_gone(max(0.5, STOP_WITHIN_S - exited))
    return exited, gone


def stopped_line(job: Job, sig: signal.Signals, step: int, phase: str) -> str:
    lines = [line for _, line in job.lines if "stopped by" in line]
    assert len(lines) == 1, job.output[-5000:]
    # The orderly clean-up says the engines and router were shut down; the watchdog, if that clean-up
    # hung, that it killed them. Either way one line, naming the step and the phase the signal met.
    assert re.fullmatch(rf"\[rank 0\] stopped by {sig.name} at step {step} \({phase}\); "
                        rf"(engines and router were shut down|its clean-up took over \d+ s, so engines and router "
                        rf"were killed); {re.escape(HINT)}", lines[0]), lines[0]
    ours = OUR_TRACEBACK.search(job.output)
    assert not ours, job.output[max(0, ours.start() - 3000):ours.end() + 1500]
    return lines[0]


# (phase, how the signal lands there, the signal). "hold R": rank R holds at the phase's start, the other
# rank waits for it in the phase's first collective; "slow": the phase runs the slow env on rank 0.
STAGES = [
    ("rollout", "slow", signal.SIGTERM),
    ("scoring", "hold 1", signal.SIGTERM),
    ("update", "hold 1", signal.SIGTERM),
    ("weight push", "hold 0", signal.SIGTERM),
    ("evaluation", "slow", signal.SIGINT),
    ("checkpoint", "hold 0", signal.SIGTERM),  # (rank 0 holds: it evaluates first, rank 1 is in the save)
]


@pytest.mark.timeout(1200)
def test_a_stop_signal_in_any_phase_of_a_step_ends_every_process_within_seconds_and_resume_continues(tmp_path):
    run_dir = tmp_path / "run"
    report = []
    for number, (phase, how, sig) in enumerate(STAGES):
        env, extra = {}, [RUN_STEPS] + ([] if number == 0 else ["trainer.resume=auto"])
        if how.startswith("hold"):
            env[TEST_HOLD_ENV] = f"{how.split()[1]}:2:{phase}:120"
            extra.append(FAST_ENV)
        elif phase != "rollout":
            env[TEST_HOLD_ENV] = f"0:2:{phase}:0"  # says when it starts, holds for no time
        job = Job(ARITHMETIC, run_dir, *extra, config="grpo_arithmetic.yaml", env=env)
        try:
            if number == 0:  # step 2's rollout starts right after step 1's checkpoint and lasts 2 s or more
                began = job.wait_for_line("checkpoint saved:", 400)
                at = began + 0.5
            else:
                began = job.wait_for_line(f"test hold: step 2 ({phase})", 400)
                at = began + (0.5 if how == "slow" else 1.5)  # the other rank is in its collective by then
            if number > 0:  # the previous stop left the run directory resumable: from step 1's checkpoint
                assert any(f"resumed from {run_dir / 'checkpoints' / 'step_00000001'} at step 1" in line
                           for _, line in job.lines), job.output[-4000:]
            exited, gone = stop(job, sig, at)
        finally:
            job.abort()
        line = stopped_line(job, sig, 2, phase)
        report.append(f"{phase}: torchrun exited {exited:.1f}s after {sig.name}, every process gone at {gone:.1f}s; "
                      f"'{line}'")
        print(f"\n{report[-1]}", flush=True)
        assert exited < STOP_WITHIN_S and gone < STOP_WITHIN_S, report[-1] + "\n" + job.output[-4000:]
        assert not list((run_dir / "checkpoints").glob("*.tmp")), "a half-written checkpoint was left"

    resumed = Job(ARITHMETIC, run_dir, RUN_STEPS, "trainer.resume=auto", FAST_ENV, config="grpo_arithmetic.yaml")
    try:
        assert resumed.wait(400) == 0, resumed.output[-4000:]
        resumed.tree.wait_all_gone(STOP_WITHIN_S)  # (torch's shared-memory manager lives 2 s past its last client)
    finally:
        resumed.abort()
    assert [m["step"] for m in read_metrics(run_dir)] == [0, 1, 2, 3]  # each step logged once, none missing
    assert json.loads((run_dir / "checkpoints" / "step_00000003" / "trainer_state.json").read_text())["step"] == 3
