"""rollout.release_memory on a real job (2 ranks, embedded engines): what the engines log they were asked,
against what the memory plan decided. `always` is the sync test's in test_job.py."""

import json
import re

import pytest

from tests.jobs import read_metrics
from tests.ppo.test_job import STEP, engine_calls, run_job

SHORT = ("trainer.total_episodes=16", "trainer.export_hf=false")  # 2 steps


def engine_control_calls(run_dir, rank: int) -> str:
    return engine_calls((run_dir / "logs" / f"engine-rank{rank}.log").read_text())


@pytest.mark.timeout(900)
@pytest.mark.parametrize("setting", ["never", "auto-fits", "auto-small-device"])
def test_release_follows_the_setting_and_the_plan(small_job, request, tmp_path, setting):
    if setting == "auto-fits":  # the default, which this machine's memory holds many times over: the shared
        run_dir, output = request.getfixturevalue("slow_prepare_run")  # 2-step sync run has it (conftest.py)
    else:
        run_dir = tmp_path / setting
        extra = {"never": ["rollout.release_memory=never"],
                 # 1.0535 GiB for a rank and its engine: the CPU reserve (1 GiB + 5%) leaves 0.9 MiB, less than the
                 # 1.9 MiB the small model's trainer needs (weights, Adam, the frozen models, a 4-sequence micro-batch)
                 "auto-small-device": ["rollout.release_memory=auto", "rollout.device_memory_gb=1.0535"]}[setting]
        output = run_job(small_job, run_dir, *SHORT, *extra)
    plan = json.loads((run_dir / "memory_plan.json").read_text())
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2]
    released = setting == "auto-small-device"
    assert plan["release"] is released and plan["fits"] is (setting != "auto-small-device")
    assert all(m["memory/released"] == float(released) for m in metrics)
    # The plan is printed once on rank 0 and its numbers are in the first step's row.
    assert output.count("memory plan (cpu, ") == 1
    assert f"release engine memory each step: {'yes' if released else 'no'}" in output
    assert ("warning: the trainer alone needs" in output) is released
    assert metrics[0]["memory_plan/kv_tokens"] == plan["kv_tokens"] and "memory_plan/kv_tokens" not in metrics[1]
    assert metrics[0]["memory_plan/fits"] == float(plan["fits"])
    for rank in (0, 1):
        calls = engine_control_calls(run_dir, rank)
        if released:  # release -> resume weights -> push -> resume KV, every step
            steps = "R(" + calls.split(" R(", 1)[1]
            assert re.fullmatch(rf"{STEP.pattern} {STEP.pattern}", steps), calls
        else:  # three pushes (start, steps 1 and 2) and not one release or resume
            assert re.fullmatch(r"B U+ E( B U+ E){2}", calls), calls
