"""DPO on the FSDP2 worker (Rafailov et al. 2023): a pair's loss is
`-log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))`, with `pi`/`ref` the policy's and the
frozen reference's log-likelihood of the response (prompt tokens excluded).

A pair's two sequences share one micro-batch; pairs are balanced across ranks by tokens. Loss
scaling as in every job: each rank sums its pairs' losses, divides by the global pair count and
multiplies by `dp_size` (FSDP averages gradients over ranks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.balance import micro_batches_for_rank, with_stand_ins
from rl_core.distributed import DataParallel
from workers.forward import token_logprobs
from workers.layout import laid_out, make_micro_batch, to_device


@dataclass
class PreferencePair:
    chosen: list[int]  # prompt + response ids
    rejected: list[int]
    prompt_length: int

    @property
    def tokens(self) -> int:
        return len(self.chosen) + len(self.rejected)


def to_pairs(examples) -> list[PreferencePair]:
    """Tokenized comparisons as (chosen, rejected) pairs: best-of-N gives the best against each other."""
    return [PreferencePair(ex.input_ids[ex.best], ex.input_ids[other], ex.prompt_length)
            for ex in examples for other in range(len(ex.input_ids)) if other != ex.best]


def collate(pairs: list[PreferencePair], pad_token_id: int, layout: str | None = None) -> dict[str, torch.Tensor]:
    """Rows 0..n-1 the chosen sequences, n..2n-1 the rejected; `action_mask` marks response tokens;
    packed in `layout` (`models.packing_layout`), the model runs on them without their padding."""
    rows = [{"input_ids": ids, "action_mask": [0] * p.prompt_length + [1] * (len(ids) - p.prompt_length)}
            for ids, p in [(p.chosen, p) for p in pairs] + [(p.rejected, p) for p in pairs]]
    batch = make_micro_batch(rows, pad_token_id)
    return laid_out(batch, layout)


def response_logprobs(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed response log-likelihood of the chosen and of the rejected rows: two `[pairs]` tensors."""
    per_token = token_logprobs(model, batch).float() * batch["action_mask"].float()
    sums = per_token.sum(-1)
    half = sums.shape[0] // 2
    return sums[:half], sums[half:]


def dpo_losses(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta: float, label_smoothing: float):
    """Per-pair loss and the implicit rewards `beta * (pi - ref)` of chosen and rejected."""
    chosen_reward = beta * (policy_chosen - ref_chosen)
    rejected_reward = beta * (policy_rejected - ref_rejected)
    logits = chosen_reward - rejected_reward
    losses = -F.logsigmoid(logits) * (1 - label_smoothing) - F.logsigmoid(-logits) * label_smoothing
    return losses, chosen_reward.detach(), rejected_reward.detach()


def micro_batches(pairs: list[PreferencePair], dp: DataParallel, max_tokens: int, pad_token_id: int,
                  layout: str | None = None):
    """This rank's (batch, real) micro-batches of whole pairs, the same count on every rank."""
    mine = micro_batches_for_rank([p.tokens for p in pairs], dp.rank, dp.size, max_tokens, packed=layout is not None)
    return [(to_device(collate([pairs[i] for i in indices], pad_token_id, layout), dp.device), real)
            for indices, real in with_stand_ins(mine)]


def pair_sums(losses, chosen_reward, rejected_reward, policy_chosen, policy_rejected) -> list[float]:
    return [float(losses.detach().sum()), float((chosen_reward > rejected_reward).float().sum()),
            float((chosen_reward - rejected_reward).sum()), float(chosen_reward.sum()), float(rejected_reward.sum()),
            float(policy_chosen.detach().sum()), float(policy_rejected.detach().sum())]


METRIC_NAMES = ("loss", "reward_accuracy", "reward_margin", "reward_chosen", "reward_rejected",
                "logps_chosen", "logps_rejected")


def train_step(trainable, reference, pairs: list[PreferencePair], dp: DataParallel, max_tokens: int,
               pad_token_id: int, beta: float, label_smoothing: float, layout: str | None = None) -> dict[str, float]:
    """One optimizer step on `pairs` (every rank passes the same pairs); returns global means."""
    sums = [0.0] * len(METRIC_NAMES)

    def loss_fn(model, item):
        batch, real = item
        with torch.no_grad():
            ref_chosen, ref_rejected = response_logprobs(reference, batch)
        chosen, rejected = response_logprobs(model, batch)
        losses, chosen_reward, rejected_reward = dpo_losses(chosen, rejected, ref_chosen, ref_rejected, beta,
                                                            label_smoothing)
        weight = 1.0 if real else 0.0  # a stand-in runs the forward (FSDP collectives) and adds nothing
        for i, value in enumerate(pair_sums(losses, chosen_reward, rejected_reward, chosen, rejected)):
            sums[i] += value * weight
        return losses.sum() * weight * dp.size / len(pairs), {}

    trainable.forward_backward(micro_batches(pairs, dp, max_tokens, pad_token_id, layout), loss_fn)
    lr = trainable.current_lr()
    grad_norm = trainable.step()
    totals = dp.sum(sums)
    metrics = {f"train/{name}": value / len(pairs) for name, value in zip(METRIC_NAMES, totals)}
    metrics.update({"train/grad_norm": grad_norm, "train/lr": lr})
    return metrics


@torch.no_grad()
def heldout_metrics(model, reference, pairs: list[PreferencePair], dp: DataParallel, max_tokens: int,
                    pad_token_id: int, beta: float, label_smoothing: float, layout: str | None = None) -> dict[str, float]:
    model.eval()
    sums = [0.0] * len(METRIC_NAMES)
    for batch, real in micro_batches(pairs, dp, max_tokens, pad_token_id, layout):
        ref_chosen, ref_rejected = response_logprobs(reference, batch)
        chosen, rejected = response_logprobs(model, batch)
        losses, chosen_reward, rejected_reward = dpo_losses(chosen, rejected, ref_chosen, ref_rejected, beta,
                                                            label_smoothing)
        if real:
            for i, value in enumerate(pair_sums(losses, chosen_reward, rejected_reward, chosen, rejected)):
                sums[i] += value
    totals = dp.sum(sums)
    return {f"eval/{name}": value / len(pairs) for name, value in zip(METRIC_NAMES, totals)}
