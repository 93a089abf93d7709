"""The critic-free estimators and their options, with numbers worked out by hand.

GRPO / RLOO / REINFORCE baselines found by group id (any order, missing members), Dr. GRPO
(no std, constant-length normaliser), DAPO (clip-higher, dynamic-sampling filter, overlong
shaping), GSPO (sequence-level ratio), and where the KL to the reference goes.
"""

import dataclasses
import math

import pytest
import torch

from rl_core.ppo import algorithms as alg
from rl_core.ppo.config import AlgorithmConfig, KLConfig, RewardConfig
from workers.worker import scale_loss
from rl_core.ppo.step import Experience, Scoring, compute_advantages, task_scores
from rl_core.ppo.scoring import apply_group_rule, has_reward_variance
from rl_core.rollout.trajectory import TokenSequence, Trajectory

RESPONSE_LENGTH = 24


def algorithm(placement: str = "reward", **fields) -> AlgorithmConfig:
    """The algorithm section of these tests: k1 KL, gamma = lambda = 1, no whitening."""
    return AlgorithmConfig(gamma=1.0, lam=1.0, whiten_rewards=False, whiten_advantages=False,
                           kl=KLConfig(estimator="k1", placement=placement), **fields)


ALGO = algorithm()

# Group "a" = [1, 2, 4]: mean 7/3, deviations -4/3, -1/3, 5/3, unbiased variance (16+1+25)/9/2 = 7/3.
A_STD = math.sqrt(7 / 3)


def test_grpo_groups_by_id_in_any_order_with_a_short_group_and_a_singleton():
    # responses of groups a, b, c interleaved; b lost a member (2 of 3), c has one left
    scores = torch.tensor([1.0, 5.0, 2.0, 6.0, 4.0, 9.0], dtype=torch.float64)
    ids = ["a", "b", "a", "b", "a", "c"]
    grpo = alg.group_advantages(scores, ids, "grpo", eps=0.0)
    # a: deviations / std; b = [5, 6]: mean 5.5, unbiased std sqrt(0.5); c alone: no baseline -> 0
    expected = [-4 / 3 / A_STD, -0.5 / math.sqrt(0.5), -1 / 3 / A_STD, 0.5 / math.sqrt(0.5), 5 / 3 / A_STD, 0.0]
    torch.testing.assert_close(grpo, torch.tensor(expected, dtype=torch.float64))
    # the same responses in another order give the same advantage to each response
    order = [5, 3, 0, 4, 1, 2]
    shuffled = alg.group_advantages(scores[order], [ids[i] for i in order], "grpo", eps=0.0)
    torch.testing.assert_close(shuffled, grpo[order])


def test_dr_grpo_keeps_the_raw_centred_reward():
    scores = torch.tensor([1.0, 5.0, 2.0, 6.0, 4.0, 9.0])
    out = alg.group_advantages(scores, ["a", "b", "a", "b", "a", "c"], "grpo", normalize_std=False)
    torch.testing.assert_close(out, torch.tensor([-4 / 3, -0.5, -1 / 3, 0.5, 5 / 3, 0.0]))


def test_rloo_and_reinforce_baselines_by_id():
    scores = torch.tensor([1.0, 5.0, 2.0, 6.0, 4.0, 9.0])
    ids = [0, 1, 0, 1, 0, 2]
    # a: 1 - (2+4)/2, 2 - (1+4)/2, 4 - (1+2)/2; b: 5 - 6, 6 - 5; c: alone -> 0
    torch.testing.assert_close(alg.group_advantages(scores, ids, "rloo"),
                               torch.tensor([-2.0, -1.0, -0.5, 1.0, 2.5, 0.0]))
    torch.testing.assert_close(alg.group_advantages(scores, ids, "reinforce"), scores - 27 / 6)
    torch.testing.assert_close(alg.zero_variance_groups(torch.tensor([1.0, 3.0, 2.0, 3.0, 5.0]), [0, 1, 0, 1, 2]),
                               torch.tensor([False, True, False, True, True]))
    with pytest.raises(ValueError, match="group ids"):
        alg.group_advantages(scores, ids[:4])


def test_clip_higher_widens_only_the_upper_bound():
    old = torch.zeros(1, 4)
    logprobs = torch.log(torch.tensor([[1.25, 1.35, 0.75, 0.70]]))  # ratios
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.ones(1, 4)
    loss, stats = alg.policy_loss(logprobs, old, advantages, mask, cliprange=0.2, cliprange_high=0.28)
    # A>0: ratio 1.25 stays (< 1.28): -1.25; ratio 1.35 is cut at 1.28: -1.28.
    # A<0: the floor stays at 0.8: max(0.75, 0.8) = 0.8 and max(0.70, 0.8) = 0.8.
    torch.testing.assert_close(loss, torch.tensor([[-1.25, -1.28, 0.8, 0.8]]))
    assert stats["clipfrac"].item() == pytest.approx(3 / 4)
    symmetric, _ = alg.policy_loss(logprobs, old, advantages, mask, cliprange=0.2)
    torch.testing.assert_close(symmetric, torch.tensor([[-1.2, -1.2, 0.8, 0.8]]))


def test_gspo_uses_one_length_normalised_ratio_per_sequence():
    old = torch.zeros(2, 3)
    logprobs = torch.tensor([[0.1, -0.3, 5.0], [0.2, 0.2, 0.2]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])  # row 0's third token is padding
    advantages = torch.tensor([[2.0, 2.0, 2.0], [-1.0, -1.0, -1.0]])
    loss, _ = alg.policy_loss(logprobs, old, advantages, mask, cliprange=0.2, sequence_ratio=True)
    s0, s1 = math.exp((0.1 - 0.3) / 2), math.exp(0.2)  # 0.9048 (inside [0.8, 1.2]) and 1.2214
    # row 0: -A s on every real token; row 1 (A < 0, s > 1.2): max(s, 1.2) = s, not clipped
    torch.testing.assert_close(loss * mask, torch.tensor([[-2 * s0, -2 * s0, 0.0], [s1, s1, s1]]))
    scale_loss(alg.loss_sum(loss, mask, "seq-mean-token-mean"), 2, 1).backward()
    # d/d logprob_t of mean_seq(mean_t(-A s)) = -A s / |y| / n_seq, the same for every token of a sequence
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-2 * s0 / 2 / 2, -2 * s0 / 2 / 2, 0.0],
                                                            [s1 / 3 / 2] * 3]))
    # GSPO's tight range: a sequence with s = 0.9048 and A < 0 is clipped as a whole (no gradient)
    logprobs.grad = None
    loss, stats = alg.policy_loss(logprobs[:1], old[:1], -advantages[:1], mask[:1], cliprange=3e-4,
                                  cliprange_high=4e-4, sequence_ratio=True)
    (loss * mask[:1]).sum().backward()
    assert logprobs.grad[0].abs().sum() == 0 and stats["clipfrac"].item() == 1.0


def test_dr_grpo_constant_length_normaliser():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    # 2 sequences x a generation budget of 4 tokens = 8, whatever their own lengths
    denominator = alg.global_denominator(mask, "seq-mean-token-sum-norm", norm_length=4)
    assert denominator.item() == 8
    assert scale_loss(alg.loss_sum(loss, mask, "seq-mean-token-sum-norm"), denominator, 1).item() == pytest.approx(7 / 8)
    # a longer answer of the same sequence now weighs more (token-mean would weigh by its share)
    assert alg.global_denominator(mask, "token-mean").item() == 3


def test_overlong_shaping_by_hand():
    lengths = torch.tensor([5, 6, 7, 8, 10, 12])
    # max 10 tokens, buffer 4: free up to 6, then -1/4 per token, -1 from 10 on
    torch.testing.assert_close(alg.overlong_penalty(lengths, 10, 4), torch.tensor([0, 0, -0.25, -0.5, -1.0, -1.0]))
    torch.testing.assert_close(alg.overlong_penalty(lengths, 10, 4, factor=0.5)[3], torch.tensor(-0.25))


# --------------------------------------------------------------------------- through the Experience


def make_traj(group, response_len, fn_reward=0.0, finish="stop", env_reward=0.0):
    """A one-sequence trajectory: 2 prompt tokens + `response_len` generated ones."""
    n = 2 + response_len
    seq = TokenSequence(input_ids=list(range(n)), action_mask=[0, 0] + [1] * response_len,
                   behaviour_logprobs=[0.0] * n, versions=[0] * n, token_rewards=[0.0] * n,
                   attention_mask=[1] * n)
    seq.token_rewards[-1] = env_reward
    return Trajectory(sequences=[seq], sample={"group_id": group}, finish_reasons=[finish],
                      fn_reward=fn_reward, reward_components={"answer": fn_reward} if fn_reward else {},
                      env_reward=env_reward)


def scored(trajs, kl_per_token=0.0):
    exp = Experience.from_trajectories(trajs)
    real = exp.batch["attention_mask"].float()
    exp.batch["old_logprobs"] = kl_per_token * real  # log(pi/ref) = kl_per_token
    exp.batch["ref_logprobs"] = torch.zeros_like(real)
    exp.batch["values"] = torch.zeros_like(real)
    exp = dataclasses.replace(exp, scores=torch.zeros(len(trajs)), rejected=torch.zeros(len(trajs), dtype=torch.bool))
    return exp


def first_advantage(targets, trajs):
    """Each one-sequence trajectory's advantage on its last token (rows are right-padded to the longest)."""
    return [round(row[traj.num_tokens - 1].item(), 5) for row, traj in zip(targets["advantages"], trajs)]


def test_advantages_are_computed_by_group_before_minibatching_with_a_failed_trajectory():
    # Prompts 7 and 8, group_size 3; one response of prompt 7 failed in its env and is missing, and the
    # batch arrives interleaved (async queue, reordering): positions would mix the groups.
    trajs = [make_traj(8, 3, fn_reward=1.0), make_traj(7, 2, fn_reward=1.0), make_traj(8, 4, fn_reward=0.0),
             make_traj(7, 3, fn_reward=0.0), make_traj(8, 2, fn_reward=1.0)]
    exp = scored(trajs)
    scores, _ = task_scores(exp, Scoring.from_config(RewardConfig(), ALGO, RESPONSE_LENGTH))
    targets, stats = compute_advantages(exp, scores, 0.0, algorithm(advantage_estimator="grpo"))
    # prompt 8: [1, 0, 1] mean 2/3, std sqrt(1/3); prompt 7 (2 left): [1, 0] mean 1/2, std sqrt(1/2)
    s8, s7 = math.sqrt(1 / 3), math.sqrt(1 / 2)
    expected = [(1 / 3) / s8, 0.5 / s7, (-2 / 3) / s8, -0.5 / s7, (1 / 3) / s8]
    assert first_advantage(targets, trajs) == pytest.approx(expected, abs=1e-4)
    for adv, traj in zip(targets["advantages"], trajs):  # the same advantage on every generated token, 0 on the prompt
        last = traj.num_tokens - 1
        assert adv[:2].abs().sum() == 0 and torch.allclose(adv[2:last + 1], adv[last].expand(traj.num_action_tokens))
        assert adv[last + 1:].abs().sum() == 0
    assert stats["groups/zero_variance_frac"] == 0.0
    # nminibatches = 2 cuts the 5 trajectories 3 + 2 at random; the advantages were fixed above over
    # whole groups, so whatever minibatch a response lands in, it trains with the value computed here.
    from workers.balance import minibatch_indices

    parts = minibatch_indices(len(trajs), 2, torch.Generator().manual_seed(0))
    assert sorted(len(p) for p in parts) == [2, 3] and sorted(sum(parts, [])) == list(range(5))
    # the group rule counts the short group; "drop" removes it, "keep" keeps its two members
    kept, stats = apply_group_rule(trajs, 3, "keep")
    assert len(kept) == 5 and stats == {"groups/count": 2, "groups/incomplete": 1, "groups/singleton": 0}
    dropped, _ = apply_group_rule(trajs, 3, "drop")
    assert [t.sample["group_id"] for t in dropped] == [8, 8, 8]


def test_kl_in_the_reward_for_rloo_and_left_to_the_loss_for_grpo():
    # log(pi/ref) = 0.1 on every token, k1: a response of n tokens has KL 0.1 n
    trajs = [make_traj(0, 2, fn_reward=1.0), make_traj(0, 4, fn_reward=1.0)]
    exp = scored(trajs, kl_per_token=0.1)
    scores, _ = task_scores(exp, Scoring.from_config(RewardConfig(), ALGO, RESPONSE_LENGTH))
    in_reward, in_reward_stats = compute_advantages(exp, scores, 0.5, algorithm(advantage_estimator="rloo", placement="reward"))
    # totals: 1 - 0.5 * 0.2 = 0.9 and 1 - 0.5 * 0.4 = 0.8; RLOO: 0.9 - 0.8, 0.8 - 0.9
    assert first_advantage(in_reward, trajs) == pytest.approx([0.1, -0.1], abs=1e-6)
    assert in_reward_stats["reward/non_score_mean"] == pytest.approx(-0.5 * 0.3)
    in_loss, in_loss_stats = compute_advantages(exp, scores, 0.5, algorithm(advantage_estimator="grpo", placement="loss"))
    assert first_advantage(in_loss, trajs) == [0.0, 0.0] and in_loss_stats["reward/non_score_mean"] == 0.0
    assert in_loss_stats["kl/mean"] == pytest.approx(0.3)  # still measured (adaptive controller, logs)
    # k3 with gradient, as the trainer adds it to the loss: d/dlogp [exp(ref - logp) - (ref - logp) - 1] = 1 - exp(ref - logp)
    logp = torch.tensor([0.1, -0.2], requires_grad=True)
    alg.kl_penalty(logp, torch.zeros(2), "k3").sum().backward()
    torch.testing.assert_close(logp.grad, 1 - torch.exp(-logp.detach()))


def test_task_scores_add_reward_functions_penalise_truncation_and_shape_overlong_answers():
    trajs = [make_traj(0, 3, fn_reward=1.0), make_traj(0, 10, fn_reward=1.0, finish="length"),
             make_traj(0, 9, fn_reward=0.0)]
    exp = scored(trajs)
    exp = dataclasses.replace(exp, scores=torch.tensor([0.5, 0.5, 0.5]))  # as if a reward model scored them too
    scores, stats = task_scores(exp, Scoring.from_config(RewardConfig(), ALGO, 10))
    torch.testing.assert_close(scores, torch.tensor([1.5, 1.5, 0.5]))
    truncating = RewardConfig(truncated_penalty=-2.0)
    scores, _ = task_scores(exp, Scoring.from_config(truncating, ALGO, 10))
    torch.testing.assert_close(scores, torch.tensor([1.5, -2.0, 0.5]))
    shaping = algorithm(overlong_buffer=4)
    scores, stats = task_scores(exp, Scoring.from_config(RewardConfig(), shaping, 10))
    torch.testing.assert_close(scores, torch.tensor([1.5, 0.5, -0.25]))  # 10 tokens: -1; 9 tokens: -0.75
    assert stats["reward/overlong_penalty_mean"] == pytest.approx(-1.75 / 3)
    # dynamic sampling keeps a group only when its rewards differ, by the same score as training
    assert has_reward_variance(trajs, Scoring.from_config(RewardConfig(), ALGO, 10))
    assert not has_reward_variance(trajs[:2], Scoring.from_config(RewardConfig(), ALGO, 10))
    assert has_reward_variance(trajs[:2], Scoring.from_config(truncating, ALGO, 10))  # the truncated one scores -2 now
    assert has_reward_variance(trajs[:2], Scoring.from_config(RewardConfig(), shaping, 10))  # and the overlong one less
