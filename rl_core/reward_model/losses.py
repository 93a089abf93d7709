"""Reward-model losses and metrics.

Losses are returned per example (no mean): the trainer sums them and divides by the *global*
number of examples so that data-parallel ranks holding different counts still produce the
gradient of the whole batch (design invariant "loss scaling").
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F


def pairwise_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor,
                  margin: torch.Tensor | float | None = None) -> torch.Tensor:
    """Bradley-Terry loss ``-log sigmoid(chosen - rejected - margin)`` per example.

    LLaMA-2 margin: a clearer preference asks for a larger score gap before the loss vanishes.
    """
    if chosen_scores.shape != rejected_scores.shape:
        raise ValueError(f"chosen scores {tuple(chosen_scores.shape)} and rejected scores "
                         f"{tuple(rejected_scores.shape)} must have the same shape")
    gap = chosen_scores.float() - rejected_scores.float()  # bf16 scores lose small gaps
    if margin is not None:
        gap = gap - torch.as_tensor(margin, dtype=gap.dtype, device=gap.device)
    return -F.logsigmoid(gap)


def best_of_n_loss(scores: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
    """Softmax cross-entropy over the N candidates, per example (OpenAI's 4-way labels)."""
    _check_scores(scores, best)
    return F.cross_entropy(scores.float(), best.long().to(scores.device), reduction="none")


def preference_loss(scores: torch.Tensor, best: torch.Tensor,
                    margin: torch.Tensor | float | None = None) -> torch.Tensor:
    """Per-example float32 loss for scores [B, N]: pairwise (+margin) if N == 2, else best-of-N."""
    _check_scores(scores, best)
    if scores.shape[1] == 2:
        best = best.long().to(scores.device)
        chosen = scores.gather(1, best[:, None]).squeeze(1)
        rejected = scores.gather(1, (1 - best)[:, None]).squeeze(1)
        return pairwise_loss(chosen, rejected, margin)
    if margin is not None and bool(torch.as_tensor(margin).ne(0).any()):
        raise ValueError(f"margins apply to pairs only, but scores have {scores.shape[1]} "
                         f"candidates per example; turn margins off for this data")
    return best_of_n_loss(scores, best)


def preference_correct(scores: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
    """``[examples]`` 1 where the preferred response scores strictly above every other one.

    Ties count as wrong, so an untrained constant model scores 0 rather than 1/N.
    """
    _check_scores(scores, best)
    best = best.long().to(scores.device)
    best_score = scores.gather(1, best[:, None])
    others = scores.masked_fill(F.one_hot(best, scores.shape[1]).bool(), float("-inf"))
    return (best_score > others).all(dim=1).float()



def _check_scores(scores: torch.Tensor, best: torch.Tensor) -> None:
    if scores.dim() != 2 or scores.shape[1] < 2:
        raise ValueError(
            f"scores must have shape [batch, candidates>=2], got {tuple(scores.shape)}")
    if best.shape != (scores.shape[0],):
        raise ValueError(f"best must have shape [{scores.shape[0]}], got {tuple(best.shape)}")
    if best.numel() and (best.min() < 0 or best.max() >= scores.shape[1]):
        raise ValueError(f"best indices must lie in [0, {scores.shape[1] - 1}], got "
                         f"{best.tolist()}")


def average_ranks(values: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """1-based ranks; tied values share the mean of the ranks they span."""
    x = torch.as_tensor(values, dtype=torch.float64).flatten()
    order = torch.argsort(x, stable=True)
    sorted_x = x[order]
    ranks = torch.empty_like(x)
    start = 0
    while start < len(x):
        end = start
        while end + 1 < len(x) and sorted_x[end + 1] == sorted_x[start]:
            end += 1
        ranks[order[start:end + 1]] = (start + end) / 2 + 1
        start = end + 1
    return ranks


def spearman(x: Sequence[float] | torch.Tensor, y: Sequence[float] | torch.Tensor) -> float:
    """Spearman correlation: Pearson correlation of average ranks (NaN if a side is constant)."""
    rx, ry = average_ranks(x), average_ranks(y)
    if rx.numel() != ry.numel():
        raise ValueError(
            f"spearman needs inputs of equal length, got {rx.numel()} and {ry.numel()}")
    if rx.numel() < 2:
        raise ValueError("spearman needs at least two points")
    dx, dy = rx - rx.mean(), ry - ry.mean()
    denominator = math.sqrt(float((dx * dx).sum()) * float((dy * dy).sum()))
    if denominator == 0.0:
        return float("nan")
    return float((dx * dy).sum()) / denominator
