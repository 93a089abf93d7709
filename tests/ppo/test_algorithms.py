"""Hand-checked numbers for rl_core.algorithms and rl_core.optim."""

import math

import pytest
import torch

from rl_core.ppo import algorithms as alg
from rl_core.rewards.lm_human_preferences import reward_gain_bias, truncated_ids
from workers.worker import scale_loss

SEED_REWARDS = torch.tensor([[1.2, 1.3, 1.4], [1.5, 1.6, 1.7], [1.8, 1.9, 2.0]], dtype=torch.float64)


# --------------------------------------------------------------------------- whitening


def test_whiten_matches_tf_moments_table_from_seed():
    expected = torch.tensor(
        [[0.05080712, 0.4381051, 0.8254035], [1.2127019, 1.6000004, 1.9872988], [2.3745968, 2.7618952, 3.1491938]],
        dtype=torch.float64,
    )
    torch.testing.assert_close(alg.whiten(SEED_REWARDS, shift_mean=False), expected, atol=1e-5, rtol=0)


def test_whiten_shift_mean_gives_zero_mean_unit_biased_std():
    out = alg.whiten(SEED_REWARDS)
    assert out.mean().abs() < 1e-12
    assert abs(out.var(unbiased=False).item() - 1.0) < 1e-5


def test_masked_whiten_uses_masked_stats_and_zeros_the_rest():
    values = torch.tensor([[1.0, 100.0, 3.0], [5.0, -7.0, 9.0]])
    mask = torch.tensor([[1, 0, 1], [0, 0, 1]], dtype=torch.bool)
    selected = torch.tensor([1.0, 3.0, 9.0])
    mean, var = selected.mean(), selected.var(unbiased=False)
    out = alg.whiten(values, mask=mask)
    assert out[~mask].eq(0).all()
    torch.testing.assert_close(out[mask], (selected - mean) / torch.sqrt(var + 1e-8))
    unshifted = alg.whiten(values, shift_mean=False, mask=mask)
    torch.testing.assert_close(unshifted[mask], out[mask] + mean)


def test_whiten_rejects_empty_mask():
    with pytest.raises(ValueError, match="empty mask"):
        alg.whiten(torch.ones(2, 2), mask=torch.zeros(2, 2, dtype=torch.bool))


# --------------------------------------------------------------------------- GAE


def reference_gae(rewards, values, mask, gamma, lam):
    """Plain-python GAE over the masked tokens of each row, dropping the holes first."""
    advantages = [[0.0] * len(row) for row in rewards]
    for b in range(len(rewards)):
        positions = [t for t in range(len(rewards[b])) if mask[b][t]]
        last_gae, next_value = 0.0, 0.0
        for t in reversed(positions):
            delta = rewards[b][t] + gamma * next_value - values[b][t]
            last_gae = delta + gamma * lam * last_gae
            advantages[b][t] = last_gae
            next_value = values[b][t]
    return advantages


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8)])
def test_gae_matches_loop_reference_with_holes(gamma, lam):
    generator = torch.Generator().manual_seed(0)
    rewards = torch.randn(4, 9, generator=generator, dtype=torch.float64)
    values = torch.randn(4, 9, generator=generator, dtype=torch.float64)
    mask = torch.tensor(
        [
            [1, 1, 1, 1, 1, 1, 1, 1, 1],
            [0, 0, 1, 1, 0, 0, 1, 1, 0],  # two sequences of one trajectory: prompt / tool-result holes
            [1, 0, 1, 0, 1, 0, 1, 0, 1],
            [0, 0, 0, 0, 0, 0, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    advantages, returns = alg.compute_gae(rewards, values, gamma, lam, mask)
    expected = reference_gae(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
    expected = torch.tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, (expected + values) * mask)


def test_gae_hole_is_transparent():
    """A row with holes gives the same advantages as the same actions packed contiguously."""
    rewards = torch.tensor([[0.1, 9.0, 0.2, 9.0, 0.3]])
    values = torch.tensor([[0.5, 9.0, 0.4, 9.0, 0.6]])
    mask = torch.tensor([[1, 0, 1, 0, 1]], dtype=torch.bool)
    holed, _ = alg.compute_gae(rewards, values, 1.0, 0.95, mask)
    packed, _ = alg.compute_gae(rewards[:, ::2].contiguous(), values[:, ::2].contiguous(), 1.0, 0.95)
    torch.testing.assert_close(holed[mask], packed.flatten())


def test_gae_single_step_by_hand():
    advantages, returns = alg.compute_gae(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.25]]), 1.0, 0.5)
    # t=1: delta = 1 - 0.25 = 0.75; t=0: delta = 0 + 0.25 - 0.5 = -0.25, A = -0.25 + 0.5 * 0.75
    torch.testing.assert_close(advantages, torch.tensor([[0.125, 0.75]]))
    torch.testing.assert_close(returns, torch.tensor([[0.625, 1.0]]))


# --------------------------------------------------------------------------- KL control and rewards


def test_adaptive_kl_controller_steps():
    controller = alg.AdaptiveKLController(0.15, target=6.0, horizon=10000)
    controller.update(12.0, 256)  # error clipped to +0.2
    assert controller.value == pytest.approx(0.15 * (1 + 0.2 * 256 / 10000))
    before = controller.value
    controller.update(5.4, 64)  # error = 5.4 / 6 - 1 = -0.1, not clipped
    assert controller.value == pytest.approx(before * (1 - 0.1 * 64 / 10000))
    restored = alg.AdaptiveKLController(1.0, target=1.0, horizon=1.0)
    restored.load_state_dict(controller.state_dict())
    assert restored.state_dict() == controller.state_dict()
    controller.update(0.0, 10000)  # error clipped to -0.2 over a whole horizon
    assert controller.value == pytest.approx(before * (1 - 0.1 * 64 / 10000) * 0.8)


def test_fixed_kl_controller_never_moves():
    controller = alg.FixedKLController(0.05)
    assert controller.update(100.0, 1000) == 0.05
    other = alg.FixedKLController(1.0)
    other.load_state_dict(controller.state_dict())
    assert other.value == 0.05


def test_kl_estimators_by_hand():
    logprobs = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -1.0])
    log_ratio = torch.tensor([0.5, -1.0])
    torch.testing.assert_close(alg.kl_penalty(logprobs, ref, "k1"), log_ratio)
    torch.testing.assert_close(alg.kl_penalty(logprobs, ref, "k2"), torch.tensor([0.125, 0.5]))
    k3 = torch.tensor([math.exp(-0.5) - 1 + 0.5, math.exp(1.0) - 1 - 1.0])
    torch.testing.assert_close(alg.kl_penalty(logprobs, ref, "k3"), k3)
    assert (alg.kl_penalty(logprobs, ref, "k3") >= 0).all()
    with pytest.raises(ValueError, match="k1"):
        alg.kl_penalty(logprobs, ref, "k4")


def test_add_kl_penalty_puts_score_on_last_action_token():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0, -4.0], [-1.0, -1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -2.0, -2.0, -4.0], [-2.0, -2.0, -2.0, -2.0]])
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 0, 1]], dtype=torch.bool)
    rewards = alg.add_kl_penalty(torch.tensor([0.4, -1.0]), logprobs, ref, mask, kl_coef=0.1)
    expected = torch.tensor([[-0.05, 0.0, 0.1 + 0.4, 0.0], [0.0, -0.1, 0.0, -0.1 - 1.0]])
    torch.testing.assert_close(rewards, expected)
    with pytest.raises(ValueError, match="no action tokens"):
        alg.add_kl_penalty(torch.zeros(2), logprobs, ref, torch.zeros_like(mask), 0.1)


def test_reward_gain_bias_normalises_a_known_distribution():
    scores = 3.0 + 2.0 * torch.randn(4096, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    gain, bias = reward_gain_bias(scores)
    assert gain == pytest.approx(0.5, rel=0.05) and bias == pytest.approx(-1.5, abs=0.1)
    normalised = gain * scores + bias
    assert normalised.mean().item() == pytest.approx(0.0, abs=1e-9)
    assert normalised.std(unbiased=False).item() == pytest.approx(1.0, abs=1e-9)
    gain, bias = reward_gain_bias(scores, target_mean=1.0, target_std=0.5)
    assert (gain * scores + bias).mean().item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="identical"):
        reward_gain_bias(torch.ones(5))


# --------------------------------------------------------------------------- truncation / rejection

PERIOD = 13


def test_truncated_ids_cuts_at_first_token_at_or_after_the_index():
    # A period before truncate_after is ignored; the first one at or after it ends the response.
    assert truncated_ids([5, PERIOD, 6, 7, PERIOD, 8, PERIOD], PERIOD, truncate_after=3) == [5, PERIOD, 6, 7, PERIOD]
    assert truncated_ids([5, 6, 7, PERIOD, 8], PERIOD, truncate_after=3) == [5, 6, 7, PERIOD]
    # None: no period at/after 3, so OpenAI's rejection sampling penalises (or does not label) it.
    assert truncated_ids([5, PERIOD, 6, 7, 8], PERIOD, truncate_after=3) is None
    assert truncated_ids([], PERIOD, truncate_after=0) is None
    with pytest.raises(ValueError, match="truncate_after"):
        truncated_ids([PERIOD], PERIOD, truncate_after=-1)


# --------------------------------------------------------------------------- losses


def test_policy_loss_by_hand():
    old = torch.zeros(1, 4)
    logprobs = torch.log(torch.tensor([[1.5, 0.5, 1.1, 1.5]]))  # ratios
    advantages = torch.tensor([[1.0, 1.0, -2.0, -1.0]])
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    loss, stats = alg.policy_loss(logprobs, old, advantages, mask, cliprange=0.2)
    # token 0: max(-1.5, -1.2) = -1.2 (clipped); token 1: max(-0.5, -0.8) = -0.5;
    # token 2: max(2.2, 2.2) = 2.2; token 3 is masked out of the stats.
    torch.testing.assert_close(loss[0, :3], torch.tensor([-1.2, -0.5, 2.2]))
    assert stats["clipfrac"].item() == pytest.approx(1 / 3)
    behaviour = torch.log(torch.tensor([[0.5, 1.0, 2.0, 0.1]]))
    weights, _ = alg.rollout_correction_weights(torch.zeros(1, 4), behaviour, torch.ones(1, 4), "tis", is_cap=1.5)
    torch.testing.assert_close(weights, torch.tensor([[1.5, 1.0, 0.5, 1.5]]))
    weighted, _ = alg.policy_loss(logprobs, old, advantages, mask, 0.2, behaviour_weights=weights)
    torch.testing.assert_close(weighted, loss * weights)


def test_policy_loss_gradient_vanishes_when_clipped():
    logprobs = torch.log(torch.tensor([[1.5, 0.9]])).requires_grad_()
    loss, _ = alg.policy_loss(logprobs, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), 0.2)
    loss.sum().backward()
    assert logprobs.grad[0, 0] == 0 and logprobs.grad[0, 1] != 0


def test_value_loss_by_hand():
    values = torch.tensor([[1.0, 0.0, 0.5]])
    old_values = torch.tensor([[0.5, 0.5, 0.5]])
    returns = torch.tensor([[0.0, 0.0, 1.0]])
    loss, stats = alg.value_loss(values, old_values, returns, torch.ones(1, 3), cliprange_value=0.2)
    # token 0: clip(1.0)->0.7: max(1.0, 0.49)=1.0; token 1: clip(0)->0.3: max(0, 0.09)=0.09; token 2: 0.25 both
    torch.testing.assert_close(loss, 0.5 * torch.tensor([[1.0, 0.09, 0.25]]))
    assert stats["vf_clipfrac"].item() == pytest.approx(1 / 3)


def test_masked_helpers_and_aggregation_modes():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    assert alg.masked_sum(loss, mask).item() == 7.0
    assert alg.masked_mean(loss, mask).item() == pytest.approx(7 / 3)
    torch.testing.assert_close(alg.masked_mean(loss, mask, dim=1), torch.tensor([1.5, 4.0]))
    assert alg.global_denominator(mask, "token-mean").item() == 3
    assert alg.global_denominator(mask, "seq-mean-token-sum").item() == 2
    # denominators as if another rank held 5 more tokens / 2 more sequences, dp_size 2
    assert scale_loss(alg.loss_sum(loss, mask, "token-mean"), 8, 2).item() == pytest.approx(7 / 8 * 2)
    assert scale_loss(alg.loss_sum(loss, mask, "seq-mean-token-sum"), 4, 2).item() == pytest.approx(7 / 4 * 2)
    assert scale_loss(alg.loss_sum(loss, mask, "seq-mean-token-mean"), 4, 2).item() == pytest.approx(5.5 / 4 * 2)
    with pytest.raises(ValueError, match="loss_agg"):
        alg.loss_sum(loss, mask, "sum")
    with pytest.raises(ValueError, match="global count"):
        scale_loss(alg.loss_sum(loss, mask, "token-mean"), 0, 1)


# --------------------------------------------------------------------------- group baselines


def test_group_advantages_of_contiguous_groups():
    scores = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 5.0])
    ids = [0, 0, 0, 1, 1, 1]
    grpo = alg.group_advantages(scores, ids, "grpo")
    torch.testing.assert_close(grpo, torch.tensor([-1.0, 0.0, 1.0, 0.0, 0.0, 0.0]), atol=1e-5, rtol=0)
    torch.testing.assert_close(alg.group_advantages(scores, ids, "grpo", normalize_std=False),
                               torch.tensor([-1.0, 0.0, 1.0, 0.0, 0.0, 0.0]))
    # RLOO: 1 - (2+3)/2, 2 - (1+3)/2, 3 - (1+2)/2
    torch.testing.assert_close(alg.group_advantages(scores, ids, "rloo"), torch.tensor([-1.5, 0.0, 1.5, 0.0, 0.0, 0.0]))
    torch.testing.assert_close(alg.group_advantages(scores, ids, "reinforce"), scores - 3.5)
    torch.testing.assert_close(alg.zero_variance_groups(scores, ids), torch.tensor([False] * 3 + [True] * 3))


def test_rejected_responses_get_the_fixed_penalty_instead_of_their_score():
    scores = torch.tensor([0.7, -0.2, 1.5])
    rejected = torch.tensor([False, True, True])
    assert alg.penalize_rejected(scores, rejected, -1.0).tolist() == [pytest.approx(0.7), -1.0, -1.0]


def corrected_gradient(mode: str, engine_temperature: float, cap: float = 2.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The policy-loss gradient of a one-token policy over 4 actions, in expectation over the engine's
    samples (each action weighted by its engine probability), next to the exact on-policy gradient.

    The engine samples at another temperature than the trainer scores at: a known mismatch."""
    from rl_core.ppo.algorithms import rollout_correction_weights

    logits = torch.tensor([-4.2, -1.9, 3.2, -5.8], requires_grad=True)
    # Every action is better than expected, the likely one most: on-policy, its logit goes up; the
    # engine's flatter samples over-count the rare ones and push it down.
    advantages = torch.tensor([0.3, 0.6, 0.9, 0.2])
    actions = torch.arange(4)[:, None]
    pi = torch.log_softmax(logits, -1)
    behaviour = torch.log_softmax(logits.detach() / engine_temperature, -1)
    old = pi.detach()
    mask = torch.ones(4, 1)
    weights, _ = rollout_correction_weights(old[actions], behaviour[actions], mask, mode, is_cap=cap)
    per_token, _ = alg.policy_loss(pi[actions], old[actions], advantages[:, None], mask, 0.2, behaviour_weights=weights)
    sampled = torch.autograd.grad((behaviour.exp()[:, None] * per_token).sum(), logits, retain_graph=True)[0]
    on_policy = torch.autograd.grad(-(old.exp() * advantages * pi).sum(), logits)[0]
    return sampled, on_policy


def test_rollout_correction_restores_the_on_policy_update_under_an_engine_mismatch():
    cosine = torch.nn.functional.cosine_similarity
    uncorrected, exact = corrected_gradient("none", engine_temperature=2.0)
    tis, _ = corrected_gradient("tis", engine_temperature=2.0, cap=100.0)
    capped, _ = corrected_gradient("tis", engine_temperature=2.0, cap=2.0)
    assert cosine(uncorrected, exact, dim=0) < -0.9  # the engine's samples push the opposite way
    torch.testing.assert_close(tis, exact)  # untruncated IS is exactly on-policy in expectation
    assert cosine(capped, exact, dim=0) > 0.99  # truncated at 2 (here no weight reaches it)
    assert exact[2] < 0 < uncorrected[2]  # the likely action's logit: up on-policy, down uncorrected
    same, exact_same = corrected_gradient("tis", engine_temperature=1.0)
    torch.testing.assert_close(same, exact_same)  # no mismatch: weights of 1 change nothing


def test_masked_importance_sampling_drops_tokens_or_whole_rows_outside_the_band():
    from rl_core.ppo.algorithms import rollout_correction_weights

    old = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]))
    behaviour = torch.log(torch.tensor([[0.5, 0.05, 0.45], [0.5, 0.45, 0.55]]))  # ratios 1, 10, 1.11 | 1, 1.11, 0.91
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    tokens, stats = rollout_correction_weights(old, behaviour, mask, "mis-token", band=(0.5, 2.0))
    assert tokens[0, 1] == 0 and tokens[0, 0] == 1 and torch.isclose(tokens[0, 2], torch.tensor(0.5 / 0.45))
    assert torch.isclose(stats["masked_frac"], torch.tensor(1 / 5)) and torch.isclose(stats["ratio_max"], torch.tensor(10.0))
    rows, stats = rollout_correction_weights(old, behaviour, mask, "mis-sequence", band=(0.5, 2.0))
    assert (rows[0] == 0).all() and (rows[1] > 0).all()  # row 0's length-normalised ratio is 2.23
    tis, _ = rollout_correction_weights(old, behaviour, mask, "tis", is_cap=2.0)
    assert tis[0, 1] == 2.0 and rollout_correction_weights(old, behaviour, mask, "none")[0] is None
