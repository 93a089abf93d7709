"""Turn-level credit for the group estimators (grpo, rloo, reinforce): `algorithm.turn_advantage`.

A multi-turn trajectory (a tool call, its result, an answer) gets one advantage A from its group, as a
single-turn one does: the group baseline of its total reward (the reward functions' and reward model's
score, plus every env reward, minus the KL when it goes in the reward). How A reaches its tokens:

- ``trajectory``: every action token gets A (SkyRL's step-wise training broadcasts the last step's
  advantage to every step the same way).
- ``discounted``: turn k of a trajectory whose last turn is T-1 gets ``turn_gamma ** (T-1-k) * A``:
  the last turn, which produced the outcome, gets full credit, each earlier one a factor gamma less
  (as AReaL's ``turn_discount`` passes the final reward back to earlier turns). Scaling A, not
  normalising discounted rewards afresh, keeps every turn's sign that of its trajectory, so an early
  turn of a better-than-average conversation is never pushed down. gamma = 1 is ``trajectory``.

Per-turn env rewards (`TokenSequence.token_rewards`, on the last token of the turn that earned them)
count in the total A comes from; they are not credited to their own turn alone.

A turn is one engine call (`TokenSequence.turns`), counted across all sequences of the trajectory, so
a template divergence that starts a new sequence does not restart the count.
"""

from __future__ import annotations

import torch

TURN_ADVANTAGES = ("trajectory", "discounted")


def turn_index(sequences: list, width: int) -> torch.Tensor:
    """`[N, width]`: each row's turn per token (-1 off generated tokens and in padding), rows right-padded
    as the batch's (`Experience.from_trajectories`)."""
    out = torch.full((len(sequences), width), -1, dtype=torch.long)
    for row, seq in enumerate(sequences):
        if len(seq.turns) != len(seq.input_ids):
            raise ValueError(f"sequence {row} has {len(seq.turns)} turn ids for {len(seq.input_ids)} tokens; build "
                             "trajectories with TrajectoryBuilder, or give TokenSequence.extend_action each turn")
        out[row, :len(seq.turns)] = torch.tensor(seq.turns, dtype=torch.long)
    return out


def turn_credit(advantages: torch.Tensor, turns: torch.Tensor | None, mask: torch.Tensor, mode: str,
                gamma: float) -> torch.Tensor:
    """Per-token advantages `[n_traj, L]` from one advantage per trajectory (`[n_traj]`).

    `turns` is each token's turn in the trajectory's chain (`[n_traj, L]`, the layout of
    `Experience.rows`; None is fine for ``trajectory``), `mask` its action tokens; tokens off the mask
    get 0. See the module docstring for `mode`.
    """
    if mode not in TURN_ADVANTAGES:
        raise ValueError(f"unknown turn_advantage={mode!r}; choose one of {TURN_ADVANTAGES}")
    per_token = advantages[:, None] * mask
    if mode == "trajectory":
        return per_token
    mask = mask.bool()
    last = torch.where(mask, turns, -1).amax(dim=1, keepdim=True)  # the trajectory's last turn with tokens
    steps_from_last = (last - turns).clamp(min=0).to(advantages.dtype)
    return per_token * torch.pow(torch.full_like(steps_from_last, gamma), steps_from_last)
