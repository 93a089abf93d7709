"""trainer.profile_steps: torch.profiler traces of the listed steps, per rank, with the phases and the engine
HTTP calls as named ranges; a step outside the run stops at parse time with one line."""

import json
import re
import subprocess
import sys

import pytest

from rl_core.config import ConfigError, load_config
from rl_core.ppo.config import PPOConfig
from rl_core.ppo.validation import validate
from tests.jobs import read_metrics


def ppo(*overrides):
    return load_config("ppo_sentiment.yaml", list(overrides), PPOConfig, validate)


def test_profile_steps_must_be_steps_of_the_run():
    assert ppo("trainer.profile_steps=[3,4]").trainer.profile_steps == [3, 4]
    assert ppo().trainer.profile_steps == []
    # the recipe: 4096 episodes / 64 per step = 64 steps
    with pytest.raises(ConfigError, match=r"names step\(s\) \[0, 65\] outside 1\.\.64, the run's steps "
                                          r"\(trainer.total_episodes=4096 / algorithm.batch_size=64\)"):
        ppo("trainer.profile_steps=[0,3,65]")
    with pytest.raises(ConfigError, match=r"outside 1\.\.2, the run's steps"):
        ppo("trainer.profile_steps=[3]", "trainer.total_episodes=128")
    with pytest.raises(ConfigError, match=r"'trainer.profile_steps' must be a list of step numbers, e.g. \[3, 4\]"):
        ppo("trainer.profile_steps=[three]")
    with pytest.raises(ConfigError, match=r"'trainer.profile_steps' must be list, got 3"):
        ppo("trainer.profile_steps=3")


@pytest.mark.timeout(120)
def test_a_step_outside_the_run_is_one_line_from_the_cli(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "rl_core.train", "trainer.profile_steps=[65]",
                           f"trainer.run_dir={run_dir}"], capture_output=True, text=True, timeout=110)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "trainer.profile_steps=[65] names step(s) [65] outside 1..64" in lines[0], proc.stderr
    assert not run_dir.exists()


def ranges(trace: dict) -> list[dict]:
    """The complete ("X") events of a Chrome trace: ops, named ranges, HTTP spans."""
    return [e for e in trace["traceEvents"] if e.get("ph") == "X"]


def within(inner: dict, outer: dict) -> bool:
    return outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + 1


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_listed_steps_write_a_trace_per_rank_with_phases_and_engine_calls(sync_run, async_run, mode):
    # The shared runs (tests/ppo/conftest.py) profile steps 2 and 3. The sync one releases every step
    # (rollout.release_memory=always), so the release and resumes appear in its trace (the memory plan would
    # keep a tiny engine resident); the async one never releases.
    run_dir, output = sync_run if mode == "sync" else async_run
    traces = sorted(p.relative_to(run_dir / "profile").as_posix() for p in (run_dir / "profile").rglob("*"))
    assert traces == ["step_2", "step_2/rank0.pt.trace.json", "step_2/rank1.pt.trace.json",
                      "step_3", "step_3/rank0.pt.trace.json", "step_3/rank1.pt.trace.json"]
    for step in (2, 3):
        for rank in (0, 1):
            path = run_dir / "profile" / f"step_{step}" / f"rank{rank}.pt.trace.json"
            assert f"[rank {rank}] profile of step {step}: {path}\n" in output
            events = ranges(json.loads(path.read_text()))  # Chrome trace JSON, as Perfetto reads it
            names = {e["name"] for e in events}
            phases = {name: next(e for e in events if e["name"] == name)
                      for name in ("rollout", "inference", "train", "sync")}
            assert phases["rollout"]["ts"] < phases["inference"]["ts"] < phases["train"]["ts"] < phases["sync"]["ts"]
            assert {"forward passes", "reward model scores", "advantages", "ppo epochs", "push", "probe",
                    "trainer probe logprobs", "ppo epoch 1 minibatch 0"} <= names, sorted(names)
            assert any(e["cat"] == "cpu_op" and e["name"].startswith("aten::") for e in events)  # CPU activity
            # This rank's engine calls: the push and the probe of the sync phase; in sync mode also the release
            # for the inference phase and the resumes around the push.
            calls = {name: [e for e in events if e["name"] == name] for name in (
                "engine POST /begin_weight_update", "engine POST /update_weights_from_tensor",
                "engine POST /end_weight_update", "engine POST /generate", "engine POST /release_memory_occupation",
                "engine POST /resume_memory_occupation")}
            released = mode == "sync"
            assert {name: bool(found) for name, found in calls.items()} == {
                name: released or "memory" not in name for name in calls}
            push = next(e for e in events if e["name"] == "push")
            assert all(within(e, push) and within(e, phases["sync"])
                       for e in calls["engine POST /update_weights_from_tensor"])
            probe = next(e for e in events if e["name"] == "probe")
            assert any(within(e, probe) for e in calls["engine POST /generate"])  # the probe's /generate
            if released:
                assert within(calls["engine POST /release_memory_occupation"][0], phases["inference"])
                assert len(calls["engine POST /resume_memory_occupation"]) == 2  # weights before the push, KV after
            generate = [e for e in events if e["name"] == "router POST /generate"]
            if rank == 0 and mode == "sync":
                # The rollout's requests, sent from the rollout's asyncio thread: recorded there, inside the
                # step's rollout phase.
                assert {e["tid"] for e in generate} & {phases["rollout"]["tid"]} == set()
                assert len(generate) == 8 and all(within(e, phases["rollout"]) for e in generate)
            else:  # rank 1 never talks to the router; in async mode rank 0's rollout runs in its own process
                assert generate == []
    assert not (run_dir / "profile" / "step_1").exists()
    assert "profile of step 1" not in output
    # A profiled step's time is its phases': the profiler's start and the trace's export are left out.
    for row in read_metrics(run_dir):
        phases = sum(row[f"perf/{phase}_s"] for phase in ("rollout", "inference", "train", "sync"))
        assert row["perf/step_s"] - phases < 0.05, row
        # Only profiled steps count their device reads and kernel-level ops, as rank 0 printed them: PPO with a
        # reward model reads the step's outputs, the reward model's scores, its metrics and the probe.
        if row["step"] in (2, 3):
            reads, ops = int(row["profile/device_reads"]), int(row["profile/kernel_ops"])
            assert reads == 4 and ops > 100, row
            assert re.search(rf"\[rank 0\] step {row['step']}: {reads} device reads \(.*\), {ops} kernel-level ops\n",
                             output), output[-2000:]
        else:
            assert "profile/device_reads" not in row


def test_the_gpu_trace_reader_splits_a_profiled_step_by_phase(sync_run):
    """scripts/gpu/trace_summary.py, which reads the GPU lease's traces, on a CPU trace of the shared run: the
    step, its four phases in order and the CPU-only ops (on CPU every op is, so the big ones are listed)."""
    run_dir, _ = sync_run
    trace = run_dir / "profile" / "step_2" / "rank0.pt.trace.json"
    proc = subprocess.run([sys.executable, "scripts/gpu/trace_summary.py", str(trace)], capture_output=True, text=True,
                          check=True)
    step, phases, kernels, host = proc.stdout.splitlines()
    assert re.fullmatch(rf"{re.escape(str(trace))}: step \d+ ms", step)
    assert [p.split()[0] for p in phases.split(":  ")[1].split(", ")] == ["rollout", "inference", "train", "sync"]
    assert kernels == "  kernels ms: "  # no device here
    total, ops = re.fullmatch(r"  CPU-only ops over 0.5 ms: (\d+) ms \(.*\); (.*)", host).groups()
    assert int(total) > 0 and re.fullmatch(r"(.+ \d+)(, .+ \d+)*", ops), host  # the largest, by name
