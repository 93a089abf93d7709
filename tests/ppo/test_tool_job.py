"""A conversation env with tools in a real GRPO job, as a user runs it (torchrun), on the embedded engine
(2 ranks, sync and async) and on real SGLang (1 rank, sync: one server start, where two side by side took
most of the case's time on 2 cores; turns of one trajectory routed over two engines are the embedded cases').

The env (tests/envs/test_chat.py `ScriptedToolEnv`) calls the multiply tool itself on each of the first
turns, because the tiny policy writes no calls of its own; the chat template lists the tools in the system
prompt (tests/envs/chat_templates/tools_in_system.jinja). Every trajectory is then three engine calls on one
growing sequence, and the trainer must score exactly the tokens the engine sampled: its logprobs of them
equal the engine's (the behaviour gap), which would not hold if any turn were re-tokenized or misplaced.
The embedded sync run also trains with `algorithm.turn_advantage=discounted` and a reward function that
reads the conversation's messages.

    python -m pytest tests/ppo/test_tool_job.py
"""

from pathlib import Path

import pytest

from tests.jobs import read_metrics, run_to_end, undocumented_metrics
from tests.ppo.test_job import torchrun_argv, wait_gone
from tests.sglang_env import require_sglang_python

TEMPLATE = Path(__file__).resolve().parents[1] / "envs" / "chat_templates" / "tools_in_system.jinja"
CASES = [("embedded", "sync"), ("sglang", "sync"), ("embedded", "async")]


@pytest.fixture(scope="module")
def tool_chat_assets(tmp_path_factory):
    """The shipped arithmetic policy's problems, and its tokenizer with a template that renders tools."""
    from transformers import AutoTokenizer

    from offline.arithmetic import ensure_arithmetic_assets

    arithmetic = ensure_arithmetic_assets(log=lambda *_: None)
    tokenizer = AutoTokenizer.from_pretrained(arithmetic.model_dir)
    tokenizer.chat_template = TEMPLATE.read_text()
    tokenizer_dir = tmp_path_factory.mktemp("tool_tokenizer")
    tokenizer.save_pretrained(tokenizer_dir)
    return arithmetic, tokenizer_dir


def run_chat_job(assets, run_dir, engine: str, mode: str, overrides: list[str]) -> list[dict]:
    """A 2-step GRPO job on the tool-chat assets (2 ranks on the embedded engine; 1 on SGLang: one server start, where
    two side by side take twice as long), run to its end; its metrics rows."""
    arithmetic, tokenizer_dir = assets
    engine_overrides = ["rollout.engine=sglang", f"rollout.sglang_python={require_sglang_python()}"] \
        if engine == "sglang" else []
    run_to_end(torchrun_argv([
        f"model.tokenizer_path={tokenizer_dir}", f"data.train_path={arithmetic.train_file}", "data.eval_path=null",
        "rollout.response_length=8", "eval.every=0", "trainer.progress=false", f"trainer.run_dir={run_dir}",
        f"trainer.mode={mode}", "rollout.weight_check_tolerance=1e-3", "algorithm.old_logprobs=trainer",
        *overrides, *engine_overrides], config="grpo_arithmetic.yaml", ranks=1 if engine == "sglang" else 2),
        timeout=600 if engine == "sglang" else 300)
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2]
    assert undocumented_metrics(metrics) == []
    return metrics


def assert_trained_on_the_engines_tokens(metrics: list[dict], mode: str, run_dir) -> None:
    """In sync mode the weights that sampled are the trainer's: its logprobs of the sampled tokens are the engine's.
    And the job left nothing running."""
    if mode == "sync":
        gaps = [m["rollout/behaviour_logprob_gap"] for m in metrics]
        assert all(gap < 1e-4 for gap in gaps), gaps
    assert not wait_gone(str(run_dir))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("engine, mode", CASES)
def test_a_tool_conversation_env_trains_on_exactly_the_sampled_tokens(tool_chat_assets, tmp_path, engine, mode):
    # The embedded sync run also gives turn-level credit and a reward function that reads the conversation.
    credit = [] if (engine, mode) != ("embedded", "sync") else [
        "algorithm.turn_advantage=discounted", "algorithm.turn_gamma=0.5",
        "reward.fns.tools.fn=tests.envs.test_chat:tool_results_read"]
    run_dir = tmp_path / "run"
    metrics = run_chat_job(tool_chat_assets, run_dir, engine, mode, [
        *credit, "env.cls=tests.envs.test_chat:ScriptedToolEnv", "env.kwargs={turns: 3}",
        "env.tools=[tests.envs.test_chat:multiply]", "env.num_envs=8", "rollout.max_turns=3",
        "algorithm.batch_size=16", "algorithm.group_size=4", "trainer.total_episodes=32"])
    for m in metrics:
        assert m["rollout/turns_mean"] == 3 and m["rollout/sequences_per_trajectory"] == 1
        assert m["rollout/tool_calls_mean"] == 2 and m["rollout/tool_errors_mean"] == 0
        assert m["rollout/template_divergences"] == 0 and m["rollout/failed"] == 0
        assert m["weight_sync/probe_gap"] < 1e-3
        assert not credit or m["reward/fn/tools"] == 2  # two tool results in every conversation
    assert_trained_on_the_engines_tokens(metrics, mode, run_dir)
