"""From trajectories to training targets: reward-model inputs, KL-penalised rewards, advantages.

The trainer fills one `Experience` per step. Per-token quantities are kept per sequence (1-D
float tensors aligned to token positions, see workers/models.py); advantages are computed per
trajectory over the chain of all its generated tokens in order (design: multi-turn
concatenation), then split back to sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rl_core import algorithms as alg
from rl_core.trajectory import Sequence, Trajectory


@dataclass
class Experience:
    trajectories: list[Trajectory]
    sequences: list[Sequence]
    seq_traj: list[int]  # trajectory index of every sequence
    traj_seqs: list[list[int]]  # sequence indices of every trajectory, in order
    old_logprobs: list[torch.Tensor] = field(default_factory=list)
    ref_logprobs: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    scores: torch.Tensor | None = None  # [n_traj] reward-model score (after gain/bias and rejection) + 0
    raw_scores: torch.Tensor | None = None  # [n_traj] score before the rejection penalty
    advantages: list[torch.Tensor] = field(default_factory=list)
    returns: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def from_trajectories(cls, trajectories: list[Trajectory]) -> "Experience":
        sequences, seq_traj, traj_seqs = [], [], []
        for t, traj in enumerate(trajectories):
            traj_seqs.append(list(range(len(sequences), len(sequences) + len(traj.sequences))))
            for seq in traj.sequences:
                sequences.append(seq)
                seq_traj.append(t)
        return cls(trajectories, sequences, seq_traj, traj_seqs)

    def seq_row(self, i: int, *keys: str) -> dict[str, list]:
        """One sequence as a collatable row (see workers.models.make_micro_batch)."""
        seq = self.sequences[i]
        # attention_mask: a left-padded query keeps its [PAD]s in the row but the engine never saw them.
        row: dict[str, list] = {"input_ids": seq.input_ids, "action_mask": seq.action_mask,
                                "attention_mask": seq.attention_mask}
        for key in keys:
            if key == "behaviour_logprobs":
                row[key] = seq.behaviour_logprobs
            else:
                row[key] = getattr(self, key)[i].tolist()
        return row


def final_response(traj: Trajectory) -> tuple[list[int], list[int]]:
    """(context ids, response ids) of the trajectory's last sequence: its final run of action tokens."""
    seq = traj.sequences[-1]
    end = len(seq.action_mask)
    start = end
    while start > 0 and seq.action_mask[start - 1]:
        start -= 1
    context = [i for i, real in zip(seq.input_ids[:start], seq.attention_mask[:start]) if real]
    return context, seq.input_ids[start:end]


def reward_model_inputs(trajectories: list[Trajectory], truncate_token: int | None,
                        truncate_after: int) -> tuple[list[list[int]], torch.Tensor]:
    """Query+response ids the reward model scores, and which rows get the rejection penalty.

    OpenAI detail (rejection sampling): the response is cut after the first `truncate_token` at
    or after index `truncate_after`; the reward model reads query + truncated response, and a
    response with no such token later gets a fixed penalty instead of its score. The policy
    still trains on the full sampled response.
    """
    contexts, responses = zip(*(final_response(t) for t in trajectories))
    inputs, rejected = [], []
    for context, response in zip(contexts, responses):
        kept = None if truncate_token is None else alg.truncated_ids(response, truncate_token, truncate_after)
        rejected.append(truncate_token is not None and kept is None)
        inputs.append(list(context) + list(response if kept is None else kept))
    return inputs, torch.tensor(rejected, dtype=torch.bool)


def _trajectory_rows(exp: Experience, per_seq: list[torch.Tensor], traj_ids: list[int]) -> torch.Tensor:
    """[n, L]: each trajectory's sequences laid end to end (the GAE chain with prompt holes)."""
    rows = [torch.cat([per_seq[s] for s in exp.traj_seqs[t]]) for t in traj_ids]
    width = max(len(r) for r in rows)
    out = torch.zeros(len(rows), width, dtype=rows[0].dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def _split_rows(exp: Experience, rows: torch.Tensor, traj_ids: list[int], target: list) -> None:
    for i, t in enumerate(traj_ids):
        offset = 0
        for s in exp.traj_seqs[t]:
            n = len(exp.sequences[s])
            target[s] = rows[i, offset: offset + n].clone()
            offset += n


def compute_advantages(exp: Experience, traj_ids: list[int], kl_coef: float, *, gamma: float, lam: float,
                       kl_estimator: str, whiten_rewards: bool, estimator: str = "gae",
                       group_size: int = 1) -> dict[str, float]:
    """Fill `exp.advantages`/`exp.returns` for the sequences of `traj_ids` (one minibatch).

    OpenAI details: per-token KL penalty folded into the rewards with the score on the last
    token; rewards whitened without shifting the mean; GAE with gamma=1, lambda=0.95; advantages
    whitened. Group baselines (GRPO/RLOO/REINFORCE) replace GAE for critic-free recipes.
    """
    n_seq = len(exp.sequences)
    if len(exp.advantages) != n_seq:
        exp.advantages, exp.returns = [None] * n_seq, [None] * n_seq
    as_float = [torch.tensor(s.action_mask, dtype=torch.float32) for s in exp.sequences]
    env_rewards = [torch.tensor(s.token_rewards, dtype=torch.float32) for s in exp.sequences]
    mask = _trajectory_rows(exp, as_float, traj_ids).bool()
    old = _trajectory_rows(exp, exp.old_logprobs, traj_ids)
    ref = _trajectory_rows(exp, exp.ref_logprobs, traj_ids)
    scores = exp.scores[traj_ids]
    kl = alg.kl_penalty(old, ref, kl_estimator) * mask
    rewards = alg.add_kl_penalty(scores, old, ref, mask, kl_coef, kl_estimator)
    rewards = rewards + _trajectory_rows(exp, env_rewards, traj_ids)
    total_reward = (rewards * mask).sum(dim=1)  # per episode, before whitening, for logging
    if estimator == "gae":
        if whiten_rewards:
            rewards = alg.whiten(rewards, shift_mean=False, mask=mask)
        values = _trajectory_rows(exp, exp.values, traj_ids)
        advantages, returns = alg.compute_gae(rewards, values, gamma, lam, mask)
    else:
        # Critic-free: one advantage per trajectory, from its total (score + env) reward, on every action token.
        totals = scores + _trajectory_rows(exp, env_rewards, traj_ids).sum(dim=1)
        per_traj = alg.group_advantages(totals, group_size, estimator)
        advantages = per_traj[:, None] * mask
        returns = advantages.clone()
    advantages = alg.whiten(advantages, mask=mask)
    _split_rows(exp, advantages, traj_ids, exp.advantages)
    _split_rows(exp, returns, traj_ids, exp.returns)
    kl_per_episode = kl.sum(dim=1)
    return {
        "kl/mean": kl_per_episode.mean().item(),
        "reward/total_mean": total_reward.mean().item(),
        "reward/non_score_mean": (-kl_coef * kl_per_episode).mean().item(),
    }
