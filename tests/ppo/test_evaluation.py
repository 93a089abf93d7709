"""Eval metrics: pass@k by hand, accuracy with failed samples counted as wrong."""

import pytest
import torch

from rl_core.config import load_config
from rl_core.ppo.config import PPOConfig
from rl_core.ppo.validation import validate
from rl_core.ppo.evaluation import eval_metrics, eval_rows, eval_sampling_params, pass_at_k
from rl_core.rollout.trajectory import TokenSequence, Trajectory


def test_pass_at_k_by_hand():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 2) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(1 / 4)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # C(3,2)/C(4,2) = 3/6 of pairs miss it
    assert pass_at_k(4, 2, 4) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(2, 3, 1)


def traj(prompt, correct, finish="stop"):
    seq = TokenSequence(input_ids=[5, 6, 7], action_mask=[0, 1, 1], behaviour_logprobs=[0.0] * 3, versions=[0] * 3,
                   token_rewards=[0.0] * 3, attention_mask=[1] * 3)
    return Trajectory(sequences=[seq], sample={"group_id": prompt, "answer": "7"}, finish_reasons=[finish],
                      reward_components={"correct": float(correct), "format": 1.0}, fn_reward=float(correct) + 0.1)


def config(*overrides):
    return load_config("ppo_sentiment.yaml", ["reward.model_path=null", "eval.n=2", "data.eval_path=x.jsonl",
                                              "reward.fns.correct.fn=rl_core.rewards.math:answer_reward",
                                              "reward.fns.format.fn=rl_core.rewards.math:format_reward",
                                              *overrides], PPOConfig, validate)


def test_accuracy_and_pass_at_k_count_failed_samples_as_wrong():
    cfg = config()
    samples = [{"group_id": p} for p in (0, 0, 1, 1, 2, 2)]  # 3 prompts x n=2
    # prompt 0: both right; prompt 1: one right, one wrong; prompt 2: one wrong, one failed (missing)
    trajs = [traj(0, True), traj(0, True), traj(1, True), traj(1, False, finish="length"), traj(2, False)]
    scores = torch.tensor([t.fn_reward for t in trajs])
    metrics = eval_metrics(cfg, samples, trajs, scores, skipped_prompts=1)
    assert metrics["eval/accuracy"] == pytest.approx(3 / 6)
    assert metrics["eval/pass@1"] == pytest.approx((1 + 0.5 + 0) / 3)
    assert metrics["eval/pass@2"] == pytest.approx((1 + 1 + 0) / 3)
    assert metrics["eval/reward_mean"] == pytest.approx(float(scores.sum()) / 6)
    assert metrics["eval/failed"] == 1 and metrics["eval/prompts"] == 3 and metrics["eval/prompts_skipped_long"] == 1
    assert metrics["eval/truncated_frac"] == pytest.approx(1 / 5) and metrics["eval/fn/format"] == pytest.approx(5 / 6)
    rows = eval_rows(cfg, _Decoder(), trajs, scores, limit=2)
    assert rows[0] == {"query": "5", "response": "6 7", "score": pytest.approx(1.1), "answer": "7", "correct": True}
    # accuracy from the component named in eval.accuracy_fn
    assert eval_metrics(config("eval.accuracy_fn=format"), samples, trajs, scores, 0)["eval/accuracy"] == 5 / 6


def test_eval_is_greedy_by_default_and_rules_are_checked():
    params = eval_sampling_params(config("rollout.stop_token_ids=[3]", "eval.response_length=9"))
    assert params["temperature"] == 0.0 and params["max_new_tokens"] == 9 and params["stop_token_ids"] == [3]
    from rl_core.config import ConfigError

    with pytest.raises(ConfigError, match="data.eval_path"):
        load_config("ppo_sentiment.yaml", ["eval.every=5"], PPOConfig, validate)
    with pytest.raises(ConfigError, match=r"^config key 'trainer.eval_every' is now 'eval.every'; rename it$"):
        load_config("ppo_sentiment.yaml", ["trainer.eval_every=5"], PPOConfig, validate)  # the key it had before
    with pytest.raises(ConfigError, match="eval.accuracy_fn"):
        config("eval.accuracy_fn=nope")


class _Decoder:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids)
