"""RL maths for LM post-training: whitening, GAE, KL control, PPO losses, group baselines.

Every function works on plain tensors. Shapes: ``[B, T]`` for per-token quantities where a row
is one trajectory's generated tokens laid out in order (a multi-sequence trajectory is
flattened into one row by the caller), ``mask`` is 1 on generated (action) tokens, ``[B]``
for per-row scores. "OpenAI" below means ``openai/lm-human-preferences``
(``lm_human_preferences/train_policy.py`` and ``utils/core.py``); docs/openai-details.md's table of
OpenAI details says where each one lives and which test checks it.
"""

from __future__ import annotations

from typing import Literal, Sequence

import torch

KLKind = Literal["k1", "k2", "k3"]
LossAgg = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
GroupKind = Literal["grpo", "rloo", "reinforce"]

# seq-mean-token-sum-norm (Dr. GRPO): token sums over a constant `sequences x norm_length`, so a
# sequence's weight does not depend on its own length.
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
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


# --------------------------------------------------------------------------- rejection (the cut: rl_core/rewards/lm_human_preferences.py)


def penalize_rejected(scores: torch.Tensor, rejected: torch.Tensor, penalty: float) -> torch.Tensor:
    """OpenAI rejection sampling: a response with no truncation token gets ``penalty`` instead of its score."""
    return torch.where(rejected, torch.full_like(scores, penalty), scores)


# --------------------------------------------------------------------------- PPO losses


ROLLOUT_CORRECTIONS = ("none", "tis", "mis-token", "mis-sequence")


def rollout_correction_weights(
    old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor, mode: str,
    is_cap: float = 2.0, band: tuple[float, float] = (0.5, 2.0),
) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """Per-token loss weights correcting for tokens sampled by the engine (pi_behaviour) while the
    loss is taken against the trainer's pi_old: the engine may be stale (async) or simply compute
    differently (bf16, its own kernels), in sync mode too.

    - ``tis``: truncated importance sampling, ``min(pi_old / pi_behaviour, is_cap)`` per token;
    - ``mis-token``: tokens whose ratio leaves ``band`` get weight 0 (masked), the rest their ratio;
    - ``mis-sequence``: the same on each row's length-normalised ratio ``exp(mean_t log r_t)``: a
      row outside the band is masked whole, the rest keep their token ratios;
    - ``none``: no weights (None).

    Returns detached weights and stats over the masked tokens: the ratio's mean, min and max and
    the fraction of tokens given weight 0.
    """
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"rollout correction {mode!r} is not one of {ROLLOUT_CORRECTIONS}")
    log_ratio = (old_logprobs - behaviour_logprobs).detach()
    ratio = torch.exp(log_ratio)
    valid = mask.bool()
    # Masked extremes without a host read (boolean indexing or `if valid.any()` would sync a GPU); 0 when empty.
    any_valid = valid.any()
    stats = {"ratio_mean": masked_mean(ratio, mask),
             "ratio_max": torch.where(any_valid, torch.where(valid, ratio, -torch.inf).max(), 0.0),
             "ratio_min": torch.where(any_valid, torch.where(valid, ratio, torch.inf).min(), 0.0)}
    low, high = band
    if mode == "none":
        weights = None
    elif mode == "tis":
        weights = ratio.clamp(max=is_cap)
    elif mode == "mis-token":
        weights = ratio * ((ratio >= low) & (ratio <= high))
    else:
        sequence_ratio = torch.exp(masked_mean(log_ratio, mask, dim=-1))[:, None]
        weights = ratio * ((sequence_ratio >= low) & (sequence_ratio <= high))
    zero = torch.zeros((), dtype=ratio.dtype) if weights is None else masked_mean((weights == 0).to(ratio.dtype), mask)
    stats["masked_frac"] = zero
    return weights, stats


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cliprange: float,
    behaviour_weights: torch.Tensor | None = None,
    cliprange_high: float | None = None,
    sequence_ratio: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped PPO surrogate per token, ``max(-A r, -A clip(r, 1-c_low, 1+c_high))``.

    ``cliprange_high`` (DAPO "clip-higher") widens the upper bound only; None keeps it at
    ``cliprange``. ``sequence_ratio`` (GSPO) replaces each token's ratio by its row's
    length-normalised sequence ratio ``exp(mean_t log r_t)``, written in GSPO's token form
    ``sg[s] * pi / sg[pi]`` so the value is ``s`` on every token and the gradient is
    ``s * grad log pi(token)``; aggregate it with ``seq-mean-token-mean``.
    ``behaviour_weights`` (decoupled PPO) multiply the per-token loss; the ratio itself stays
    against ``old_logprobs`` recomputed by the trainer. Returns ``(per_token_loss, stats)``
    with detached ``clipfrac`` and ``approx_kl`` over masked tokens; aggregate the loss with
    :func:`loss_sum`.
    """
    _check_same_shape(logprobs, mask)
    log_ratio = logprobs - old_logprobs
    if sequence_ratio:
        sequence_log_ratio = masked_mean(log_ratio.detach(), mask, dim=-1)[:, None]
        log_ratio = logprobs - logprobs.detach() + sequence_log_ratio
    ratio = torch.exp(log_ratio)
    high = cliprange if cliprange_high is None else cliprange_high
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - cliprange, 1.0 + high)
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


def global_denominator(mask: torch.Tensor, loss_agg: LossAgg, norm_length: int = 1) -> torch.Tensor:
    """This rank's share of the loss denominator; all-reduce (sum) it over ranks and micro-batches.

    ``token-mean`` counts action tokens; the ``seq-mean-*`` modes count sequences that have at
    least one action token, and ``seq-mean-token-sum-norm`` multiplies that count by the
    constant ``norm_length`` (Dr. GRPO: the generation budget). Returned as an int64 scalar so
    the sum stays exact.
    """
    _check_loss_agg(loss_agg)
    if loss_agg == "token-mean":
        count = mask.bool().sum()
    else:
        count = mask.bool().any(dim=-1).sum()
        if loss_agg == "seq-mean-token-sum-norm":
            if norm_length < 1:
                raise ValueError(f"seq-mean-token-sum-norm needs norm_length >= 1, got {norm_length}")
            count = count * norm_length
    return count.to(torch.int64)


def loss_sum(per_token_loss: torch.Tensor, mask: torch.Tensor, loss_agg: LossAgg) -> torch.Tensor:
    """A micro-batch's share of the loss before it is divided by the global count of
    :func:`global_denominator` (the batch worker scales it: ``workers.worker``): the token sum for
    ``token-mean`` and the ``seq-mean-token-sum`` modes, the sum of per-row token means for
    ``seq-mean-token-mean``."""
    _check_loss_agg(loss_agg)
    _check_same_shape(per_token_loss, mask)
    if loss_agg == "seq-mean-token-mean":
        return masked_mean(per_token_loss, mask, dim=-1).sum()
    return masked_sum(per_token_loss, mask)  # token sums: same numerator, different counts


# --------------------------------------------------------------------------- group baselines


def _group_index(group_ids: Sequence | torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    """Dense group index per response (0..G-1, in order of first appearance) and G."""
    ids = group_ids.tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
    if len(ids) != n:
        raise ValueError(f"{n} scores but {len(ids)} group ids; give every response the id of its prompt's group")
    dense: dict = {}
    index = torch.tensor([dense.setdefault(g, len(dense)) for g in ids], dtype=torch.long)
    return index, len(dense)


def group_stats(scores: torch.Tensor, group_ids: Sequence | torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per response: its group's size, score sum and unbiased std (0 for a group of one)."""
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D [N], got shape {tuple(scores.shape)}")
    index, n_groups = _group_index(group_ids, scores.numel())
    sizes = torch.zeros(n_groups, dtype=scores.dtype).index_add_(0, index, torch.ones_like(scores))
    sums = torch.zeros(n_groups, dtype=scores.dtype).index_add_(0, index, scores)
    means = sums / sizes
    squares = torch.zeros(n_groups, dtype=scores.dtype).index_add_(0, index, (scores - means[index]) ** 2)
    stds = torch.sqrt(squares / (sizes - 1).clamp(min=1))
    return sizes[index], sums[index], stds[index]


def group_advantages(
    scores: torch.Tensor,
    group_ids: Sequence | torch.Tensor,
    kind: GroupKind = "grpo",
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Critic-free per-response advantages; ``group_ids[i]`` names the prompt group of response i.

    Groups are found by id, not by position, so responses may come in any order and a group
    may be short of members (a failed or stale-dropped trajectory): its baseline uses the
    members present, and a group of one has no baseline and gets advantage 0.
    ``grpo``: ``(r - group mean) / (group std + eps)`` (std skipped when ``normalize_std`` is
    False, Dr. GRPO; unbiased std as in the GRPO paper's implementations); ``rloo``: ``r``
    minus the mean of the *other* responses of its group; ``reinforce``: ``r`` minus the batch mean.
    """
    if kind not in GROUP_KINDS:
        raise ValueError(f"unknown group baseline kind={kind!r}; choose one of {GROUP_KINDS}")
    sizes, sums, stds = group_stats(scores, group_ids)
    if kind == "reinforce":
        return scores - scores.mean()
    alone = sizes < 2
    if kind == "rloo":
        leave_one_out_mean = (sums - scores) / (sizes - 1).clamp(min=1)
        return torch.where(alone, torch.zeros_like(scores), scores - leave_one_out_mean)
    centred = scores - sums / sizes
    if normalize_std:
        centred = centred / (stds + eps)
    return torch.where(alone, torch.zeros_like(scores), centred)


def zero_variance_groups(scores: torch.Tensor, group_ids: Sequence | torch.Tensor) -> torch.Tensor:
    """Bool ``[N]``: True for responses whose group scored all the same (no signal to learn from)."""
    _, _, stds = group_stats(scores, group_ids)
    return stds == 0


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment: 0 up to ``max_length - buffer`` tokens, then falling
    linearly to ``-factor`` at ``max_length`` (and staying there), so near-truncated answers
    are discouraged gradually instead of all getting the same reward as finished ones."""
    if buffer < 1 or buffer > max_length:
        raise ValueError(f"overlong buffer must be in [1, max_length={max_length}], got {buffer}")
    excess = (lengths.to(torch.float32) - (max_length - buffer)).clamp(min=0, max=buffer)
    return -factor * excess / buffer
