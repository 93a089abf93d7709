"""Outside agent code trained in a real GRPO job (torchrun; 2 ranks on the embedded engine, 1 on real SGLang): the
example agent (envs/examples/calculator_agent.py, a plain `openai` client with a calculator tool) talks to the
job's OpenAI-compatible endpoint (envs/agent.py) for two calls per trajectory.

The tiny policy writes no calls, so `env.tool_parser` reads each turn as one calculator call
(tests/envs/test_agent.py `scripted_calls`) and the agent runs it and sends the result back. Every trajectory
is then two engine calls on one growing sequence, and the trainer must score exactly the tokens the engine
sampled: in sync mode its logprobs of them equal the engine's (the behaviour gap).

    python -m pytest tests/ppo/test_agent_job.py
"""

import subprocess

import pytest

from tests.ppo.test_job import torchrun_argv
from tests.ppo.test_tool_job import assert_trained_on_the_engines_tokens, run_chat_job
from tests.ppo.test_tool_job import tool_chat_assets  # noqa: F401 - the fixture

CASES = [("embedded", "sync"), ("sglang", "sync"), ("embedded", "async")]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("engine, mode", CASES)
def test_an_openai_client_agent_trains_on_exactly_the_sampled_tokens(tool_chat_assets, tmp_path, engine, mode):
    run_dir = tmp_path / "run"
    metrics = run_chat_job(tool_chat_assets, run_dir, engine, mode, [
        "env.cls=envs.agent:AgentEnv", "env.kwargs={agent: envs.examples.calculator_agent:run}",
        "env.tool_parser=tests.envs.test_agent:scripted_calls", "env.num_envs=8", "rollout.max_turns=2",
        "algorithm.batch_size=8", "algorithm.group_size=4", "trainer.total_episodes=16"])
    for m in metrics:
        assert m["rollout/turns_mean"] == 2 and m["rollout/sequences_per_trajectory"] == 1
        assert m["rollout/tool_calls_mean"] == 2 and m["rollout/agent/tool_calls"] == 1
        assert m["rollout/template_divergences"] == 0 and m["rollout/failed"] == 0
        assert m["weight_sync/probe_gap"] < 1e-3
    assert_trained_on_the_engines_tokens(metrics, mode, run_dir)


@pytest.mark.timeout(120)
def test_a_wrong_agent_path_stops_the_job_at_start_with_one_line(tmp_path):
    proc = subprocess.run(torchrun_argv(["env.cls=envs.agent:AgentEnv", "env.kwargs={agent: my_pkg.nope:run}",
                                         f"trainer.run_dir={tmp_path / 'run'}"], config="grpo_arithmetic.yaml"),
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode != 0
    lines = (proc.stdout + proc.stderr).splitlines()
    assert any(line.startswith("[rank 0] error: env.kwargs.agent: cannot import module 'my_pkg.nope'") for line in lines)
