"""RL maths for LM post-training: whitening, GAE, KL control, PPO losses, group baselines.

Every function works on plain tensors. Shapes: ``[B, T]`` for per-token quantities where a row
is one trajectory's generated tokens laid out in order (a multi-sequence trajectory is
flattened into one row by the caller), ``mask`` is 1 on generated (action) tokens, ``[B]``
for per-row scores. "OpenAI" below means ``openai/lm-human-preferences``
(``lm_human_preferences/train_policy.py`` and ``utils/core.py``); the README's table of
OpenAI details says where each one lives and which test checks it.
"""

from __future__ import annotations

from typing import Literal, Sequence

import torch

KLKind = Literal["k1", "k2", "k3"]
LossAgg = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
GroupKind = Literal["grpo", "rloo", "reinforce"]

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
KL_KINDS = ("k1", "k2", "k3")
GROUP_KINDS = ("grpo", "rloo", "reinforce")
WHITEN_EPS = 1e-8


# --------------------------------------------------------------------------- masked helpers


def _check_same_shape(values: torch.Tensor, mask: torch.Tensor) -> None:
    if values.shape != mask.shape:
        raise ValueError(f"values shape {tuple(values.shape)} and mask shape {tuple(mask.shape)} differ; "
                         "pass a mask with exactly one entry per value")


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is set (over everything, or along ``dim``)."""
    _check_same_shape(values, mask)
    masked = values * mask.to(values.dtype)
    return masked.sum() if dim is None else masked.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is set; 0 where the mask selects nothing."""
    count = mask.to(values.dtype).sum() if dim is None else mask.to(values.dtype).sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Biased variance over masked entries (``tf.nn.moments`` divides by N, not N-1)."""
    mean = masked_mean(values, mask)
    return masked_mean((values - mean) ** 2, mask)


# --------------------------------------------------------------------------- whitening


def whiten(values: torch.Tensor, shift_mean: bool = True, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Normalise to zero mean / unit variance with the *biased* variance (OpenAI ``utils.whiten``, TF moments).

    ``shift_mean=False`` adds the mean back after scaling, as OpenAI does for rewards.
    With ``mask``, statistics use masked entries only and masked-out entries come back as 0.
    """
    if mask is None:
        mask = torch.ones_like(values, dtype=torch.bool)
    _check_same_shape(values, mask)
    if not mask.any():
        raise ValueError("whiten got an empty mask; there is nothing to normalise")
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask.to(values.dtype)


# --------------------------------------------------------------------------- GAE


def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    gamma: float,
    lam: float,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over each row's action tokens, in order.

    Unmasked positions are skipped as if absent, so the tokens of all sequences of one
    multi-turn trajectory chain into a single episode; the value after the last action is 0.
    Returns ``(advantages, returns)``, both 0 outside the mask.
    """
    if mask is None:
        mask = torch.ones_like(rewards, dtype=torch.bool)
    if rewards.shape != values.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and values {tuple(values.shape)} "
                         "must have the same [B, T] shape")
    _check_same_shape(rewards, mask)
    if rewards.dim() != 2:
        raise ValueError(f"compute_gae expects [B, T] tensors, got {rewards.dim()} dimensions")
    mask = mask.bool()
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    running_gae = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        acting = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        gae_here = delta + gamma * lam * running_gae
        # A hole (prompt / tool-result token) carries the next action's value and GAE through unchanged.
        running_gae = torch.where(acting, gae_here, running_gae)
        next_value = torch.where(acting, values[:, t], next_value)
        advantages[:, t] = torch.where(acting, gae_here, torch.zeros_like(gae_here))
    returns = (advantages + values) * mask.to(values.dtype)
    return advantages, returns


# --------------------------------------------------------------------------- KL control


class AdaptiveKLController:
    """Adaptive KL coefficient (OpenAI ``AdaptiveKLController``, Ziegler et al. 2019): steer the KL towards ``target``."""

    def __init__(self, init_kl_coef: float, target: float, horizon: float) -> None:
        if target <= 0 or horizon <= 0:
            raise ValueError(f"AdaptiveKLController needs target > 0 and horizon > 0, got target={target}, "
                             f"horizon={horizon}; use FixedKLController for a constant coefficient")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        self.value, self.target, self.horizon = float(state["value"]), float(state["target"]), float(state["horizon"])


class FixedKLController:
    """Constant KL coefficient with the same interface as :class:`AdaptiveKLController`."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KLKind = "k1") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled-token logprobs (Schulman's k1/k2/k3)."""
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        # (r - 1) - log r with r = p_ref / p: unbiased and always >= 0.
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"unknown KL estimator kind={kind!r}; choose one of {KL_KINDS}")


def _last_action_index(action_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last set position of each row; ValueError if a row has none."""
    has_action = action_mask.bool().any(dim=1)
    if not has_action.all():
        empty = torch.nonzero(~has_action).flatten().tolist()
        raise ValueError(f"rows {empty} have no action tokens in action_mask; drop them before scoring")
    positions = torch.arange(action_mask.shape[1], device=action_mask.device)
    return torch.where(action_mask.bool(), positions, -1).max(dim=1).values


def add_kl_penalty(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    kl_coef: float,
    kind: KLKind = "k1",
) -> torch.Tensor:
    """Per-token rewards: ``-kl_coef * kl`` on every action token plus the score on the last one (OpenAI ``compute_rewards``)."""
    _check_same_shape(logprobs, action_mask)
    if scores.shape != (logprobs.shape[0],):
        raise ValueError(f"scores must have shape [B]={logprobs.shape[0]}, got {tuple(scores.shape)}")
    mask = action_mask.to(logprobs.dtype)
    rewards = -kl_coef * kl_penalty(logprobs, ref_logprobs, kind) * mask
    last = _last_action_index(action_mask)
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    rewards[rows, last] += scores.to(rewards.dtype)
    return rewards


def reward_gain_bias(scores: torch.Tensor, target_mean: float = 0.0, target_std: float = 1.0) -> tuple[float, float]:
    """Affine ``(gain, bias)`` so that ``gain * scores + bias`` has the target mean/std (biased std, as TF)."""
    scores = scores.detach().double().flatten()
    if scores.numel() < 2:
        raise ValueError(f"reward_gain_bias needs at least 2 scores, got {scores.numel()}")
    mean, std = scores.mean(), scores.var(unbiased=False).sqrt()
    if std <= 0:
        raise ValueError("all scores are identical, so no gain can normalise their std; sample more varied responses")
    gain = target_std / std.item()
    return gain, target_mean - gain * mean.item()


# --------------------------------------------------------------------------- truncation / rejection


def truncated_ids(response: Sequence[int], truncate_token: int, truncate_after: int) -> list[int] | None:
    """One response cut through its first ``truncate_token`` at index ``>= truncate_after``; None if
    it has none (rejection-sampling detail: such a response is penalised, or not labelled)."""
    if truncate_after < 0:
        raise ValueError(f"truncate_after must be >= 0, got {truncate_after}")
    for index in range(truncate_after, len(response)):
        if response[index] == truncate_token:
            return list(response[: index + 1])
    return None


def penalize_rejected(scores: torch.Tensor, rejected: torch.Tensor, penalty: float) -> torch.Tensor:
    """OpenAI rejection sampling: a response with no truncation token gets ``penalty`` instead of its score."""
    return torch.where(rejected, torch.full_like(scores, penalty), scores)


# --------------------------------------------------------------------------- PPO losses


def truncated_importance_weights(
    old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, cap: float
) -> torch.Tensor:
    """Detached ``min(pi_old / pi_behaviour, cap)`` correcting for async (stale-engine) sampling."""
    if cap <= 0:
        raise ValueError(f"importance weight cap must be > 0, got {cap}")
    return torch.exp(old_logprobs - behaviour_logprobs).clamp(max=cap).detach()


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cliprange: float,
    behaviour_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped PPO surrogate per token, ``max(-A r, -A clip(r, 1-c, 1+c))``.

    ``behaviour_weights`` (decoupled PPO) multiply the per-token loss; the ratio itself stays
    against ``old_logprobs`` recomputed by the trainer. Returns ``(per_token_loss, stats)``
    with detached ``clipfrac`` and ``approx_kl`` over masked tokens; aggregate the loss with
    :func:`aggregate_loss`.
    """
    _check_same_shape(logprobs, mask)
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - cliprange, 1.0 + cliprange)
    loss = torch.maximum(unclipped, clipped)
    if behaviour_weights is not None:
        loss = loss * behaviour_weights.detach()
    stats = {
        "clipfrac": masked_mean((clipped > unclipped).to(logprobs.dtype), mask).detach(),
        "approx_kl": masked_mean(0.5 * log_ratio.detach() ** 2, mask),
    }
    return loss, stats


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss per token, ``0.5 * max((v-R)^2, (clip(v, old±c)-R)^2)`` (OpenAI ``PPOTrainer.loss``)."""
    _check_same_shape(values, mask)
    clipped_values = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    unclipped_loss = (values - returns) ** 2
    clipped_loss = (clipped_values - returns) ** 2
    loss = 0.5 * torch.maximum(unclipped_loss, clipped_loss)
    stats = {"vf_clipfrac": masked_mean((clipped_loss > unclipped_loss).to(values.dtype), mask).detach()}
    return loss, stats


# --------------------------------------------------------------------------- loss scaling


def _check_loss_agg(loss_agg: str) -> None:
    if loss_agg not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg={loss_agg!r}; choose one of {LOSS_AGG_MODES}")


def global_denominator(mask: torch.Tensor, loss_agg: LossAgg) -> torch.Tensor:
    """This rank's share of the loss denominator; all-reduce (sum) it over ranks and micro-batches.

    ``token-mean`` counts action tokens; the ``seq-mean-*`` modes count sequences that have at
    least one action token. Returned as an int64 scalar so the sum stays exact.
    """
    _check_loss_agg(loss_agg)
    if loss_agg == "token-mean":
        count = mask.bool().sum()
    else:
        count = mask.bool().any(dim=-1).sum()
    return count.to(torch.int64)


def aggregate_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    loss_agg: LossAgg,
    global_denominator: int | float | torch.Tensor,
    dp_size: int,
) -> torch.Tensor:
    """Reduce a micro-batch's per-token loss to the scalar to call ``backward`` on.

    Ranks hold different numbers of sequences after balancing, so a per-rank mean would weight
    ranks unequally. Each rank therefore sums its losses, divides by the *global* count (from
    :func:`global_denominator`, all-reduced over ranks and summed over the minibatch's
    micro-batches) and multiplies by ``dp_size`` because FSDP averages gradients over ranks:
    the accumulated gradient equals the single-process gradient of the whole minibatch.
    """
    _check_loss_agg(loss_agg)
    _check_same_shape(per_token_loss, mask)
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    denominator = float(global_denominator)
    if denominator <= 0:
        raise ValueError(f"global_denominator must be > 0, got {denominator}; "
                         "the minibatch has no action tokens on any rank")
    if loss_agg == "seq-mean-token-mean":
        numerator = masked_mean(per_token_loss, mask, dim=-1).sum()
    else:  # token sums: same numerator for token-mean and seq-mean-token-sum, different counts
        numerator = masked_sum(per_token_loss, mask)
    return numerator / denominator * dp_size


# --------------------------------------------------------------------------- group baselines


def _grouped(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D [N], got shape {tuple(scores.shape)}")
    if group_size < 1 or scores.numel() % group_size != 0:
        raise ValueError(f"{scores.numel()} scores do not split into groups of {group_size}; "
                         "keep the responses of each prompt together and group_size a divisor of the batch")
    return scores.view(-1, group_size)


def group_advantages(
    scores: torch.Tensor,
    group_size: int,
    kind: GroupKind = "grpo",
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Critic-free per-response advantages; responses of one prompt are contiguous.

    ``grpo``: ``(r - group mean) / (group std + eps)`` (std skipped when ``normalize_std`` is
    False; unbiased std as in the GRPO paper's implementations); ``rloo``: ``r`` minus the mean
    of the *other* responses of its group; ``reinforce``: ``r`` minus the batch mean.
    """
    if kind not in GROUP_KINDS:
        raise ValueError(f"unknown group baseline kind={kind!r}; choose one of {GROUP_KINDS}")
    groups = _grouped(scores, group_size)
    if kind == "reinforce":
        return scores - scores.mean()
    if group_size < 2:
        raise ValueError(f"{kind} needs group_size >= 2 (several responses per prompt), got {group_size}")
    if kind == "rloo":
        leave_one_out_mean = (groups.sum(dim=1, keepdim=True) - groups) / (group_size - 1)
        return (groups - leave_one_out_mean).flatten()
    centred = groups - groups.mean(dim=1, keepdim=True)
    if normalize_std:
        centred = centred / (groups.std(dim=1, keepdim=True) + eps)
    return centred.flatten()


def zero_variance_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """Bool ``[N // group_size]``: True for groups whose responses all scored the same (no signal; filter them)."""
    groups = _grouped(scores, group_size)
    return (groups == groups[:, :1]).all(dim=1)
