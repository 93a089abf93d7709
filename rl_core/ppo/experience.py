"""From scored trajectories to training targets: reward-model inputs, KL-penalised rewards, advantages.

One `Experience` per step carries the batch as `[N, T]` tensors, one row per sequence, every
per-token quantity aligned to token positions (see workers/forward.py). Advantages run per
trajectory over the chain of all its generated tokens in order (multi-turn concatenation), so the
maths works on `[n_trajectories, L]` rows (`Experience.rows`) and the results go back to the
sequences' rows (`Experience.split`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl_core.ppo import algorithms as alg
from rl_core.ppo.config import AlgorithmConfig, RewardConfig
from rl_core.rewards.lm_human_preferences import truncated_ids
from rl_core.rollout.trajectory import TokenSequence, Trajectory
from workers.layout import make_micro_batch


@dataclass
class Experience:
    """One step's batch, built once at the rollout boundary: every sequence of every trajectory as a
    row of `[N, T]` tensors in `batch` (`input_ids`, `attention_mask`, `position_ids`, `action_mask`,
    `behaviour_logprobs`, `token_rewards`). Later stages add theirs (`old_logprobs`, `ref_logprobs`,
    `values`, then `advantages`, `returns`) and select rows by index; nothing is re-collated."""
    trajectories: list[Trajectory]
    sequences: list[TokenSequence]
    traj_seqs: list[list[int]]  # row (sequence) indices of every trajectory, in order
    batch: dict[str, torch.Tensor]
    chain: torch.Tensor  # [n_traj, L] flat index into [N, T] of each trajectory's tokens end to end; -1 after
    scores: torch.Tensor | None = None  # [n_traj] reward-model score after gain/bias (0 without a reward model)
    rejected: torch.Tensor | None = None  # [n_traj] no truncation token: gets the fixed penalty instead

    @classmethod
    def from_trajectories(cls, trajectories: list[Trajectory], pad_token_id: int = 0) -> "Experience":
        sequences, traj_seqs = [], []
        for traj in trajectories:
            traj_seqs.append(list(range(len(sequences), len(sequences) + len(traj.sequences))))
            sequences.extend(traj.sequences)
        # attention_mask: a left-padded query keeps its [PAD]s in the row but the engine never saw them.
        batch = make_micro_batch([{"input_ids": s.input_ids, "action_mask": s.action_mask,
                                   "attention_mask": s.attention_mask, "behaviour_logprobs": s.behaviour_logprobs,
                                   "token_rewards": s.token_rewards} for s in sequences], pad_token_id)
        width = batch["input_ids"].shape[1]
        chains = [torch.cat([s * width + torch.arange(len(sequences[s])) for s in seqs]) for seqs in traj_seqs]
        chain = torch.full((len(chains), max(len(c) for c in chains)), -1, dtype=torch.long)
        for t, positions in enumerate(chains):
            chain[t, :len(positions)] = positions
        return cls(trajectories, sequences, traj_seqs, batch, chain)

    def rows(self, per_token: torch.Tensor) -> torch.Tensor:
        """`[N, T]` -> `[n_traj, L]`: each trajectory's sequences laid end to end (the GAE chain, prompts
        as holes), 0 after its end."""
        return per_token.flatten()[self.chain.clamp(min=0)].masked_fill(self.chain < 0, 0)

    def split(self, rows: torch.Tensor) -> torch.Tensor:
        """Inverse of `rows`: `[n_traj, L]` -> `[N, T]`."""
        out = torch.zeros(self.batch["input_ids"].numel(), dtype=rows.dtype)
        kept = self.chain >= 0
        out[self.chain[kept]] = rows[kept]
        return out.view(self.batch["input_ids"].shape)

    def select(self, traj_ids: list[int]) -> dict[str, torch.Tensor]:
        """The rows of trajectories `traj_ids` (a minibatch), every tensor of the batch."""
        index = torch.tensor([s for t in traj_ids for s in self.traj_seqs[t]])
        return {key: value[index] for key, value in self.batch.items()}


@dataclass
class Targets:
    """What the PPO epochs train towards, per sequence, plus the step's reward statistics."""
    advantages: torch.Tensor  # [N, T], like the batch's rows
    returns: torch.Tensor
    stats: dict[str, float]


def reward_model_inputs(trajectories: list[Trajectory], truncate_token: int | None,
                        truncate_after: int) -> tuple[list[list[int]], torch.Tensor]:
    """Query+response ids the reward model scores, and which rows get the rejection penalty.

    OpenAI rejection sampling: the response is cut after the first `truncate_token` at or after
    index `truncate_after`; the reward model reads query + truncated response, and a response
    with no such token gets a fixed penalty instead of its score. The policy still trains on the
    full sampled response.
    """
    inputs, rejected = [], []
    for traj in trajectories:
        context, response = traj.final_response()
        kept = None if truncate_token is None else truncated_ids(response, truncate_token, truncate_after)
        rejected.append(truncate_token is not None and kept is None)
        inputs.append(list(context) + list(response if kept is None else kept))
    return inputs, torch.tensor(rejected, dtype=torch.bool)


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


def has_reward_variance(group: list[Trajectory], reward: RewardConfig, algo: AlgorithmConfig,
                        response_length: int) -> bool:
    """DAPO dynamic sampling's filter: the group's rewards are not all equal. The score as in
    training, but for the reward model, which scores after the rollout, plus the env's rewards."""
    no_model = torch.zeros(len(group))
    scores, _ = trajectory_scores(group, no_model, no_model.bool(), reward, algo, response_length)
    return len({s + t.env_reward for s, t in zip(scores.tolist(), group)}) > 1


def compute_advantages(exp: Experience, scores: torch.Tensor, kl_coef: float, algo: AlgorithmConfig) -> Targets:
    """Advantages and returns of the whole batch, computed once per step before minibatching.

    `scores` are the per-trajectory scores of `task_scores`. OpenAI details: the KL penalty is
    folded into per-token rewards with the score on the last action token; rewards are whitened
    without shifting their mean; GAE with gamma=1, lambda=0.95; advantages whitened. (OpenAI
    whitens per minibatch; with the recipe's one minibatch that is the same.) Group baselines
    (GRPO/RLOO/REINFORCE) replace GAE for critic-free recipes: groups are found by `group_id`, so
    order and missing members do not matter. With the KL in the loss (`algo.kl.placement`), it is
    left out of the rewards.
    """
    gamma, lam, kl_estimator, estimator = algo.gamma, algo.lam, algo.kl.estimator, algo.advantage_estimator
    kl_in_reward = algo.kl.placement == "reward"
    batch = exp.batch
    mask = exp.rows(batch["action_mask"]).bool()
    old, ref = exp.rows(batch["old_logprobs"]), exp.rows(batch["ref_logprobs"])
    env_rewards = exp.rows(batch["token_rewards"])
    kl = alg.kl_penalty(old, ref, kl_estimator) * mask
    kl_per_episode = kl.sum(dim=1)
    reward_kl_coef = kl_coef if kl_in_reward else 0.0
    stats = {}
    if estimator == "gae":
        # 1. per-token rewards: -kl_coef * KL on every action token, the score on the last one, env rewards
        rewards = alg.add_kl_penalty(scores, old, ref, mask, reward_kl_coef, kl_estimator) + env_rewards
        total_reward = (rewards * mask).sum(dim=1)  # per episode, before whitening, for logging
        # 2. reward whitening (scale only), 3. GAE over each trajectory's action tokens
        if algo.whiten_rewards:
            rewards = alg.whiten(rewards, shift_mean=False, mask=mask)
        advantages, returns = alg.compute_gae(rewards, exp.rows(batch["values"]), gamma, lam, mask)
    else:
        # 3'. critic-free: one advantage per trajectory from its total reward (score + env, minus the
        # summed KL when it goes in the reward, as RLOO does), put on every one of its action tokens
        total_reward = scores + env_rewards.sum(dim=1) - reward_kl_coef * kl_per_episode
        ids = group_ids(exp.trajectories)
        advantages = alg.group_advantages(total_reward, ids, estimator, normalize_std=algo.normalize_group_std)
        advantages = advantages[:, None] * mask
        returns = advantages.clone()
        stats = {"groups/zero_variance_frac": alg.zero_variance_groups(total_reward, ids).float().mean().item()}
    # 4. advantage whitening
    if algo.whiten_advantages:
        advantages = alg.whiten(advantages, mask=mask)
    stats.update({"kl/mean": kl_per_episode.mean().item(), "reward/total_mean": total_reward.mean().item(),
                  "reward/non_score_mean": (-reward_kl_coef * kl_per_episode).mean().item()})
    return Targets(exp.split(advantages), exp.split(returns), stats)


def trajectory_scores(trajectories: list[Trajectory], model_scores: torch.Tensor, rejected: torch.Tensor,
                      reward: RewardConfig, algo: AlgorithmConfig, response_length: int
                      ) -> tuple[torch.Tensor, dict[str, float]]:
    """The one definition of a trajectory's score before the KL, for training, evaluation and DAPO's
    filter: the reward-model score (OpenAI rejection penalty: no truncation token at/after
    `truncate_after` gives `reward.penalty`), plus the weighted reward functions; a response cut by
    the length limit gets `reward.truncated_penalty` instead when set; DAPO's overlong shaping on top.
    Env rewards are not in it: they sit on their own tokens."""
    scores = alg.penalize_rejected(model_scores, rejected, reward.penalty)
    stats: dict[str, float] = {}
    if any(t.reward_components for t in trajectories):
        scores = scores + torch.tensor([t.fn_reward for t in trajectories], dtype=scores.dtype)
    if reward.truncated_penalty is not None:  # cut by the length limit: this score instead of a partial answer's
        truncated = torch.tensor([t.truncated for t in trajectories])
        scores = torch.where(truncated, torch.full_like(scores, reward.truncated_penalty), scores)
    if algo.overlong_buffer:
        lengths = torch.tensor([len(t.final_response()[1]) for t in trajectories])
        shaping = alg.overlong_penalty(lengths, response_length, algo.overlong_buffer, algo.overlong_penalty_factor)
        scores = scores + shaping.to(scores.dtype)
        stats["reward/overlong_penalty_mean"] = shaping.mean().item()
    return scores, stats


def task_scores(exp: Experience, reward: RewardConfig, algo: AlgorithmConfig,
                response_length: int) -> tuple[torch.Tensor, dict[str, float]]:
    """`trajectory_scores` of a scored batch."""
    return trajectory_scores(exp.trajectories, exp.scores, exp.rejected, reward, algo, response_length)
