"""DPO on the FSDP2 worker (Rafailov et al. 2023): a pair's loss is
`-log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))`, with `pi`/`ref` the policy's and the
frozen reference's log-likelihood of the response (prompt tokens excluded).

On the one batch worker (`workers.worker`): a pair's two sequences are one unit (one micro-batch),
pairs are balanced across ranks by tokens, and the loss is the mean over the global batch's pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.forward import token_logprobs
from workers.layout import rows_to_batch
from workers.read_back import read_back
from workers.worker import BatchWorker


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


def collate(pairs: list[PreferencePair], pad_token_id: int) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
    """The step's `[2n, T]` batch, each pair's chosen row then its rejected one (`chosen` 1 and 0), and the
    pairs as the worker's units (a pair's two rows share a micro-batch); `action_mask` marks the response."""
    rows = [{"input_ids": ids, "action_mask": [0] * p.prompt_length + [1] * (len(ids) - p.prompt_length)}
            for p in pairs for ids in (p.chosen, p.rejected)]
    batch = rows_to_batch(rows, pad_token_id)
    batch["chosen"] = torch.tensor([1, 0] * len(pairs), dtype=torch.bool)
    return batch, [[2 * i, 2 * i + 1] for i in range(len(pairs))]


def response_logprobs(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed response log-likelihood of the chosen and of the rejected rows: two `[pairs]` tensors."""
    per_token = token_logprobs(model, batch, actions_only=True).float() * batch["action_mask"].float()
    sums = per_token.sum(-1)
    chosen = batch["chosen"].to(sums.device)
    return sums[chosen], sums[~chosen]


def dpo_losses(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta: float, label_smoothing: float):
    """Per-pair loss and the implicit rewards `beta * (pi - ref)` of chosen and rejected."""
    chosen_reward = beta * (policy_chosen - ref_chosen)
    rejected_reward = beta * (policy_rejected - ref_rejected)
    logits = chosen_reward - rejected_reward
    losses = -F.logsigmoid(logits) * (1 - label_smoothing) - F.logsigmoid(-logits) * label_smoothing
    return losses, chosen_reward.detach(), rejected_reward.detach()


METRIC_NAMES = ("loss", "reward_accuracy", "reward_margin", "reward_chosen", "reward_rejected",
                "logps_chosen", "logps_rejected")


def pair_losses(model, reference, batch: dict[str, torch.Tensor], beta: float,
                label_smoothing: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The micro-batch's pair losses summed, and the sums behind METRIC_NAMES."""
    with torch.no_grad():
        ref_chosen, ref_rejected = response_logprobs(reference, batch)
    chosen, rejected = response_logprobs(model, batch)
    losses, chosen_reward, rejected_reward = dpo_losses(chosen, rejected, ref_chosen, ref_rejected, beta,
                                                        label_smoothing)
    sums = [losses.detach().sum(), (chosen_reward > rejected_reward).float().sum(),
            (chosen_reward - rejected_reward).sum(), chosen_reward.sum(), rejected_reward.sum(),
            chosen.detach().sum(), rejected.detach().sum()]
    return losses.sum(), sums


def train_step(trainable, reference, worker: BatchWorker, pairs: list[PreferencePair], pad_token_id: int,
               beta: float, label_smoothing: float) -> dict[str, float]:
    """One optimizer step on `pairs` (every rank passes the same pairs); returns global means."""
    batch, units = collate(pairs, pad_token_id)

    def loss_fn(model, micro_batch):
        loss, sums = pair_losses(model, reference, micro_batch, beta, label_smoothing)
        return loss, {f"sum/{name}": value for name, value in zip(METRIC_NAMES, sums)}

    metrics, _ = worker.forward_backward(trainable, batch, loss_fn, len(pairs), units)
    lr = trainable.current_lr()
    metrics = read_back({**metrics, "grad_norm": [trainable.step()]})  # the step's one read from the device
    grad_norm = metrics["grad_norm"][0]
    totals = worker.sum_over_ranks([sum(metrics[f"sum/{name}"]) for name in METRIC_NAMES])
    out = {f"train/{name}": value / len(pairs) for name, value in zip(METRIC_NAMES, totals)}
    out.update({"train/grad_norm": grad_norm, "train/lr": lr})
    return out


def heldout_metrics(model, reference, worker: BatchWorker, pairs: list[PreferencePair], pad_token_id: int,
                    beta: float, label_smoothing: float) -> dict[str, float]:
    model.eval()
    batch, units = collate(pairs, pad_token_id)
    totals = worker.sums(batch, lambda b: pair_losses(model, reference, b, beta, label_smoothing)[1], units)
    return {f"eval/{name}": value / len(pairs) for name, value in zip(METRIC_NAMES, totals)}
