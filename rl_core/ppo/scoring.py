"""How a trajectory's score is made, and the group rules, for the step, the batch source (DAPO's filter, short
groups) and evaluation alike: the one definition of a score before the KL."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl_core.ppo import algorithms as alg
from rl_core.ppo.config import AlgorithmConfig, RewardConfig
from rl_core.rollout.trajectory import Trajectory


@dataclass(frozen=True)
class Scoring:
    """How a trajectory's score is made (`trajectory_scores`), resolved once from the config."""
    penalty: float  # OpenAI rejection penalty: the score of a response with no truncation token
    truncate_id: int | None  # that token (None: no rejection), at or after index `truncate_after`
    truncate_after: int
    truncated_penalty: float | None  # a response cut by the length limit scores this instead
    response_length: int
    overlong_buffer: int  # DAPO overlong shaping (0: off)
    overlong_penalty_factor: float

    @classmethod
    def from_config(cls, reward: RewardConfig, algo: AlgorithmConfig, response_length: int,
                    truncate_id: int | None = None) -> "Scoring":
        return cls(reward.penalty, truncate_id, reward.truncate_after, reward.truncated_penalty, response_length,
                   algo.overlong_buffer, algo.overlong_penalty_factor)


def group_ids(trajectories: list[Trajectory]) -> list:
    """Each trajectory's prompt group (`group_id`, set by the prompt stream and carried in its sample)."""
    ids = [t.sample.get("group_id") for t in trajectories]
    if any(g is None for g in ids):
        raise ValueError("a group advantage estimator needs 'group_id' in every sample (rl_core.rollout.prompts "
                         "sets it); a custom prompt stream must give the responses of one prompt the same id")
    return ids


def apply_group_rule(trajectories: list[Trajectory], group_size: int, rule: str) -> tuple[list, dict[str, float]]:
    """Groups short of members (a failed or stale-dropped trajectory): counted, and dropped when
    `rule` is "drop"; with "keep" their baseline comes from the members present."""
    sizes: dict = {}
    for group in group_ids(trajectories):
        sizes[group] = sizes.get(group, 0) + 1
    incomplete = {g for g, n in sizes.items() if n < group_size}
    if rule == "drop" and len(incomplete) < len(sizes):  # never drop the whole batch
        trajectories = [t for t in trajectories if t.sample["group_id"] not in incomplete]
    return trajectories, {"groups/count": len(sizes), "groups/incomplete": len(incomplete),
                          "groups/singleton": sum(1 for n in sizes.values() if n == 1)}


def trajectory_scores(trajectories: list[Trajectory], model_scores: torch.Tensor, rejected: torch.Tensor,
                      scoring: Scoring) -> tuple[torch.Tensor, dict[str, float]]:
    """The one definition of a trajectory's score before the KL, for training, evaluation and DAPO's
    filter: the reward-model score (OpenAI rejection penalty: no truncation token at/after
    `truncate_after` gives `reward.penalty`), plus the weighted reward functions; a response cut by
    the length limit gets `reward.truncated_penalty` instead when set; DAPO's overlong shaping on top.
    Env rewards are not in it: they sit on their own tokens."""
    scores = alg.penalize_rejected(model_scores, rejected, scoring.penalty)
    stats: dict[str, float] = {}
    if any(t.reward_components for t in trajectories):
        scores = scores + torch.tensor([t.fn_reward for t in trajectories], dtype=scores.dtype)
    if scoring.truncated_penalty is not None:  # cut by the length limit: this score instead of a partial answer's
        truncated = torch.tensor([t.truncated for t in trajectories])
        scores = torch.where(truncated, torch.full_like(scores, scoring.truncated_penalty), scores)
    if scoring.overlong_buffer:
        lengths = torch.tensor([len(t.final_response()[1]) for t in trajectories])
        shaping = alg.overlong_penalty(lengths, scoring.response_length, scoring.overlong_buffer,
                                       scoring.overlong_penalty_factor)
        scores = scores + shaping.to(scores.dtype)
        stats["reward/overlong_penalty_mean"] = shaping.mean().item()
    return scores, stats


def has_reward_variance(group: list[Trajectory], scoring: Scoring) -> bool:
    """DAPO dynamic sampling's filter: the group's rewards are not all equal. The score as in
    training, but for the reward model, which scores after the rollout, plus the env's rewards."""
    no_model = torch.zeros(len(group))
    scores, _ = trajectory_scores(group, no_model, no_model.bool(), scoring)
    return len({s + t.env_reward for s, t in zip(scores.tolist(), group)}) > 1
