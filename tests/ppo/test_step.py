"""The step after the rollout: compute_advantages on multi-sequence trajectories against a plain-Python
reference, and the reward model's inputs."""

import math

import pytest
import torch

from rl_core.ppo.config import AlgorithmConfig, KLConfig
from rl_core.ppo.step import Experience, compute_advantages, reward_model_rows
from rl_core.rollout.trajectory import TokenSequence, Trajectory


def sequence(context: int, actions: int, offset: float, env_reward_at_end: float = 0.0) -> tuple[TokenSequence, dict]:
    """A sequence of `context` prompt tokens then `actions` generated ones, with made-up per-token numbers."""
    seq = TokenSequence()
    seq.extend_context(list(range(1, context + 1)))
    seq.extend_action(list(range(10, 10 + actions)), [-0.5] * actions, [0] * actions)
    seq.token_rewards[-1] += env_reward_at_end
    n = context + actions
    numbers = {"old": [0.1 * offset + 0.03 * t for t in range(n)],
               "ref": [0.1 * offset - 0.02 * t * t for t in range(n)],
               "values": [offset - 0.25 * t for t in range(n)]}
    return seq, numbers


def plain_reference(chains, scores, kl_coef, gamma, lam):
    """Per trajectory: (old, ref, value, env reward) of each action token in order; lists in, lists out."""
    rewards = []
    for chain, score in zip(chains, scores):
        row = [-kl_coef * (old - ref) + env for old, ref, _, env in chain]
        row[-1] += score  # the score lands on the last action token of the whole trajectory
        rewards.append(row)
    flat = [r for row in rewards for r in row]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((r - mean) ** 2 for r in flat) / len(flat) + 1e-8)  # biased, as tf.nn.moments
    rewards = [[(r - mean) / std + mean for r in row] for row in rewards]  # whitened, mean kept (OpenAI)
    advantages, returns = [], []
    for chain, row in zip(chains, rewards):
        values = [v for _, _, v, _ in chain]
        adv, running = [0.0] * len(row), 0.0
        for t in reversed(range(len(row))):
            next_value = values[t + 1] if t + 1 < len(row) else 0.0
            running = row[t] + gamma * next_value - values[t] + gamma * lam * running
            adv[t] = running
        advantages.append(adv)
        returns.append([a + v for a, v in zip(adv, values)])
    flat = [a for row in advantages for a in row]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((a - mean) ** 2 for a in flat) / len(flat) + 1e-8)
    return [[(a - mean) / std for a in row] for row in advantages], returns


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.7)])
def test_gae_runs_over_both_sequences_of_a_trajectory_in_order(gamma, lam):
    # Trajectory 0: two sequences (a fresh state after a tool call), an env reward on its first action.
    first, first_numbers = sequence(context=3, actions=2, offset=0.4, env_reward_at_end=0.5)
    second, second_numbers = sequence(context=2, actions=3, offset=-0.3)
    other, other_numbers = sequence(context=4, actions=4, offset=1.1)
    trajectories = [Trajectory([first, second], sample={}), Trajectory([other], sample={})]
    exp = Experience.from_trajectories(trajectories)
    numbers = [first_numbers, second_numbers, other_numbers]
    for key, name in (("old_logprobs", "old"), ("ref_logprobs", "ref"), ("values", "values")):
        exp.batch[key] = torch.zeros(exp.batch["input_ids"].shape)
        for row, n in enumerate(numbers):
            exp.batch[key][row, :len(n[name])] = torch.tensor(n[name])
    scores, kl_coef = torch.tensor([0.8, -1.2]), 0.15

    algo = AlgorithmConfig(gamma=gamma, lam=lam, whiten_rewards=True, advantage_estimator="gae",
                           kl=KLConfig(estimator="k1"))
    targets, stats = compute_advantages(exp, scores, kl_coef, algo)

    def chain(seqs):
        out = []
        for seq, n in seqs:
            for t, acting in enumerate(seq.action_mask):
                if acting:
                    out.append((n["old"][t], n["ref"][t], n["values"][t], seq.token_rewards[t]))
        return out
    chains = [chain([(first, first_numbers), (second, second_numbers)]), chain([(other, other_numbers)])]
    expected_adv, expected_ret = plain_reference(chains, scores.tolist(), kl_coef, gamma, lam)

    def actions_of(per_seq, seq_ids):
        return [float(per_seq[s][t]) for s in seq_ids for t, acting in enumerate(exp.sequences[s].action_mask)
                if acting]
    for t, seq_ids in enumerate(exp.traj_seqs):
        assert actions_of(targets["advantages"], seq_ids) == pytest.approx(expected_adv[t], abs=1e-5)
        assert actions_of(targets["returns"], seq_ids) == pytest.approx(expected_ret[t], abs=1e-5)
    for s, seq in enumerate(exp.sequences):  # prompt and observation tokens get nothing
        assert all(float(targets["advantages"][s][t]) == 0.0 for t, acting in enumerate(seq.action_mask) if not acting)
    assert stats["kl/mean"] == pytest.approx(
        sum(sum(old - ref for old, ref, _, _ in c) for c in chains) / 2, abs=1e-6)


def test_reward_model_reads_the_last_sequence_cut_at_the_truncation_token():
    seq = TokenSequence()
    seq.extend_context([7, 8], num_padding=1)  # a left pad the engine never saw
    seq.extend_action([5, 9, 6, 9, 4], [0.0] * 5, [0] * 5)
    late = TokenSequence()
    late.extend_context([7, 8])
    late.extend_action([5, 5, 5], [0.0] * 3, [0] * 3)
    first_turn, last_turn = TokenSequence(), TokenSequence()  # two turns: the last sequence's final response
    first_turn.extend_context([3])
    first_turn.extend_action([9, 9], [0.0] * 2, [0] * 2)
    last_turn.extend_context([3, 9, 9, 4])
    last_turn.extend_action([6, 1, 9, 2], [0.0] * 4, [0] * 4)
    early = TokenSequence()  # the truncation token only before index 2 of the response: rejected
    early.extend_context([7])
    early.extend_action([9, 5, 5, 1], [0.0] * 4, [0] * 4)
    exp = Experience.from_trajectories([Trajectory([seq], {}), Trajectory([late], {}),
                                        Trajectory([first_turn, last_turn], {}), Trajectory([early], {})])
    rows, rejected = reward_model_rows(exp, truncate_token=9, truncate_after=2)
    read = [row[mask.bool()].tolist() for row, mask in zip(rows["input_ids"], rows["attention_mask"])]
    assert read[0] == [8, 5, 9, 6, 9] and not rejected[0]  # cut through the first 9 at response index >= 2
    assert read[1] == [7, 8, 5, 5, 5] and rejected[1]  # no 9 at all: full response, penalised later
    assert read[2] == [3, 9, 9, 4, 6, 1, 9] and not rejected[2]  # the earlier turn's 9s are not the response's
    assert read[3] == [7, 9, 5, 5, 1] and rejected[3]
    # the kept tokens keep their positions (a left pad is no position), and nothing in the rows trains
    assert rows["position_ids"][0][rows["attention_mask"][0].bool()].tolist() == [0, 1, 2, 3, 4]
    assert not rows["action_mask"].any()
    unchanged, none_rejected = reward_model_rows(exp, truncate_token=None, truncate_after=0)
    assert torch.equal(unchanged["attention_mask"], exp.batch["attention_mask"][[0, 1, 3, 4]])
    assert not none_rejected.any()


def test_a_phase_adds_only_its_declared_rows_and_never_overwrites_the_batch():
    seq, _ = sequence(context=2, actions=2, offset=0.0)
    exp = Experience.from_trajectories([Trajectory([seq], {})])
    zeros = torch.zeros_like(exp.batch["input_ids"], dtype=torch.float32)
    scored = exp.with_rows("forward passes", {"old_logprobs": zeros}, scores=torch.ones(1))
    assert "old_logprobs" in scored.batch and "old_logprobs" not in exp.batch  # a new batch, the old one as it was
    assert scored.scores.tolist() == [1.0] and exp.scores is None
    with pytest.raises(ValueError, match=r"may add only .*'advantages'.*\['values'\] besides"):
        scored.with_rows("advantages", {"advantages": zeros, "values": zeros})
    with pytest.raises(ValueError, match=r"\['old_logprobs'\] again"):
        scored.with_rows("forward passes", {"old_logprobs": zeros})
