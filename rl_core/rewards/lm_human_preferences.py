"""Reward details of OpenAI's lm-human-preferences that the PPO and reward-model jobs share, so
neither imports the other: the rejection-sampling cut and the reward normalisation."""

from __future__ import annotations

from typing import Sequence

import torch


def truncated_ids(response: Sequence[int], truncate_token: int, truncate_after: int) -> list[int] | None:
    """One response cut through its first ``truncate_token`` at index ``>= truncate_after``; None if
    it has none (rejection-sampling detail: such a response is penalised, or not labelled)."""
    if truncate_after < 0:
        raise ValueError(f"truncate_after must be >= 0, got {truncate_after}")
    for index in range(truncate_after, len(response)):
        if response[index] == truncate_token:
            return list(response[: index + 1])
    return None


def truncation_ends(ids: torch.Tensor, response_start: torch.Tensor, response_end: torch.Tensor,
                    truncate_token: int, truncate_after: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`truncated_ids` for a batch of rows at once: each row's response is `ids[start:end]` (`[b, 1]` bounds).
    Returns (`[b, 1]` end of what the reward model reads: through the first `truncate_token` at response index
    `>= truncate_after`, else the whole response, `[b]` True where there is no such token)."""
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    cut_at = (ids == truncate_token) & (positions >= response_start + truncate_after) & (positions < response_end)
    first = torch.where(cut_at, positions, ids.shape[1]).amin(dim=1, keepdim=True)
    rejected = ~cut_at.any(dim=1)
    return torch.where(rejected[:, None], response_end, first + 1), rejected


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
