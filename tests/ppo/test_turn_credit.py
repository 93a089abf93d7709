"""Turn-level credit (algorithm.turn_advantage): per-token advantages of a group of 1-, 2- and 3-turn
trajectories, worked out by hand, and the config rules."""

import math

import pytest
import torch

from rl_core.config import ConfigError, load_config
from rl_core.ppo.config import AlgorithmConfig, KLConfig, PPOConfig, RewardConfig
from rl_core.ppo.validation import validate
from rl_core.ppo.step import Experience, Scoring, compute_advantages, task_scores
from rl_core.rollout.trajectory import TokenSequence, Trajectory


def sequence(*parts) -> TokenSequence:
    """Parts in order: ("ctx", n) context tokens, or ("act", n, turn) n tokens generated in `turn`."""
    seq = TokenSequence()
    for part in parts:
        start = len(seq) + 1
        ids = list(range(start, start + part[1]))
        if part[0] == "ctx":
            seq.extend_context(ids)
        else:
            seq.extend_action(ids, [0.0] * len(ids), [0] * len(ids), turn=part[2])
    return seq


def group():
    """One prompt group of three trajectories, totals 0, 1 and 5:
    - 1 turn, reward function 0;
    - 2 turns with nothing between them (the env's next state added no tokens), an env reward of 1 on turn 0;
    - 3 turns over two sequences (a template divergence before turn 2), reward function 5."""
    one = Trajectory([sequence(("ctx", 2), ("act", 2, 0))], {"group_id": "g"}, num_turns=1,
                     reward_components={"answer": 0.0}, fn_reward=0.0)
    two_seq = sequence(("ctx", 2), ("act", 2, 0), ("act", 1, 1))
    two_seq.token_rewards[3] = 1.0  # on the last token of the turn that earned it, as TrajectoryBuilder puts it
    two = Trajectory([two_seq], {"group_id": "g"}, env_reward=1.0, num_turns=2)
    three = Trajectory([sequence(("ctx", 2), ("act", 1, 0), ("ctx", 1), ("act", 2, 1)),
                        sequence(("ctx", 3), ("act", 1, 2))], {"group_id": "g"}, num_turns=3,
                       reward_components={"answer": 5.0}, fn_reward=5.0)
    return [one, two, three]


def advantages(estimator: str, turn_advantage: str, turn_gamma: float = 1.0) -> list[list[float]]:
    trajs = group()
    exp = Experience.from_trajectories(trajs)
    zeros = torch.zeros_like(exp.batch["attention_mask"], dtype=torch.float32)
    exp = exp.with_rows("forward passes", dict(old_logprobs=zeros, ref_logprobs=zeros.clone(), values=zeros.clone()),
                        scores=torch.zeros(3), rejected=torch.zeros(3, dtype=torch.bool))
    algo = AlgorithmConfig(advantage_estimator=estimator, whiten_advantages=False, turn_advantage=turn_advantage,
                           turn_gamma=turn_gamma, kl=KLConfig(placement="loss"))
    scores, _ = task_scores(exp, Scoring.from_config(RewardConfig(), algo, 24))
    targets, _ = compute_advantages(exp, scores, 0.0, algo)
    return [[round(x, 5) for x in row[:len(seq)].tolist()] for row, seq in zip(targets["advantages"], exp.sequences)]


def per_token(a0: float, a1: float, a2: float, gamma: float) -> list[list[float]]:
    """The rows of `group()` (one per sequence, the third trajectory's two last) with advantages a0, a1, a2."""
    rows = [[0, 0, a0, a0],
            [0, 0, gamma * a1, gamma * a1, a1],
            [0, 0, gamma ** 2 * a2, 0, gamma * a2, gamma * a2],
            [0, 0, 0, a2]]
    return [[pytest.approx(x, abs=1e-5) for x in row] for row in rows]


# GRPO on totals [0, 1, 5]: mean 2, deviations -2, -1, 3, unbiased std sqrt((4 + 1 + 9) / 2) = sqrt(7).
GRPO = [-2 / math.sqrt(7), -1 / math.sqrt(7), 3 / math.sqrt(7)]
# RLOO: 0 - (1 + 5) / 2, 1 - (0 + 5) / 2, 5 - (0 + 1) / 2.
RLOO = [-3.0, -1.5, 4.5]


def test_trajectory_credit_puts_the_trajectory_advantage_on_every_action_token():
    assert advantages("grpo", "trajectory") == per_token(*GRPO, gamma=1.0)
    # gamma 1 discounts nothing: the same numbers
    assert advantages("grpo", "discounted", 1.0) == per_token(*GRPO, gamma=1.0)


@pytest.mark.parametrize("estimator, expected", [("grpo", GRPO), ("rloo", RLOO), ("reinforce", [-2.0, -1.0, 3.0])])
def test_discounted_credit_gives_turn_k_of_T_gamma_to_the_T_minus_1_minus_k_of_the_advantage(estimator, expected):
    # gamma 0.5: the last turn full credit, the one before half, the one before that a quarter; the two
    # adjacent turns of the second trajectory are told apart by their turn ids, not by context between them,
    # and the third trajectory's count goes on across its new sequence.
    assert advantages(estimator, "discounted", 0.5) == per_token(*expected, gamma=0.5)


def test_config_rules_for_turn_credit():
    def grpo(*overrides):
        return load_config("grpo_tools_arithmetic.yaml", list(overrides), PPOConfig, validate)

    assert grpo().algorithm.turn_advantage == "trajectory" and grpo().algorithm.turn_gamma == 1.0
    assert grpo("algorithm.turn_advantage=discounted", "algorithm.turn_gamma=0.5").algorithm.turn_gamma == 0.5
    with pytest.raises(ConfigError, match=r"turn_advantage=discounted needs a group estimator: set "
                                          r"algorithm.advantage_estimator to grpo, rloo or reinforce"):
        grpo("algorithm.turn_advantage=discounted", "algorithm.advantage_estimator=gae")
    for bad in ("0", "1.5", "-0.5"):
        with pytest.raises(ConfigError, match=r"'algorithm.turn_gamma' must be in \(0, 1\]"):
            grpo("algorithm.turn_advantage=discounted", f"algorithm.turn_gamma={bad}")
    with pytest.raises(ConfigError, match=r"'algorithm.turn_advantage' = 'per_turn' is not one of: trajectory, discounted"):
        grpo("algorithm.turn_advantage=per_turn")
