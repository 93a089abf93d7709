"""SFT on the FSDP2 worker: rows balanced across ranks by tokens, length-sorted micro-batches, and
a loss that is the mean over every trained token of the global batch.

Loss scaling: each rank divides its token sum by the *global* count of trained tokens in the
step and multiplies by `dp_size`, because FSDP averages gradients over ranks; the gradient is
then that of the global token mean whatever the split (the rule the PPO job uses).
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Callable

import torch

from rl_core.balance import micro_batches_for_rank, with_stand_ins
from rl_core.distributed import DataParallel
from rl_core.sft.data import SFTExample
from workers.decode import decode
from workers.forward import token_logprobs_and_hits
from workers.layout import laid_out, make_micro_batch


def collate(examples: list[SFTExample], pad_token_id: int, layout: str | None = None) -> dict[str, torch.Tensor]:
    """Padded rows, or packed in `layout` (`models.packing_layout`): the model runs without their padding."""
    rows = [{"input_ids": e.input_ids, "action_mask": e.loss_mask} for e in examples]
    batch = make_micro_batch(rows, pad_token_id)
    return laid_out(batch, layout)


def token_sums(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(negative log-likelihood summed over trained tokens, how many the argmax got right, how many)."""
    logprobs, hits = token_logprobs_and_hits(model, batch)  # about each trained token (0 elsewhere)
    mask = batch["action_mask"][:, 1:].to(logprobs.device).float()  # a first token is never predicted
    logprobs, hits = logprobs[:, 1:], hits[:, 1:]
    return -(logprobs * mask).sum(), (hits * mask).sum().detach(), mask.sum()


def micro_batches(examples: list[SFTExample], dp: DataParallel, max_tokens: int, pad_token_id: int,
                  layout: str | None = None):
    """This rank's micro-batches of `examples` (the whole step's rows, the same list on every rank):
    (batch, real) pairs, the same count on every rank (a stand-in with `real` False when a rank has none).
    `max_tokens` bounds the padded size, or packed (`layout`) the real tokens."""
    lengths = [len(e.input_ids) for e in examples]
    mine = micro_batches_for_rank(lengths, dp.rank, dp.size, max_tokens, packed=layout is not None)
    return [(collate([examples[i] for i in indices], pad_token_id, layout), real)
            for indices, real in with_stand_ins(mine)]


def train_step(trainable, examples: list[SFTExample], dp: DataParallel, max_tokens: int,
               pad_token_id: int, layout: str | None = None) -> dict[str, float]:
    """One optimizer step on `examples` (every rank passes the same rows); returns global metrics."""
    global_tokens = sum(sum(e.loss_mask[1:]) for e in examples)
    batches = micro_batches(examples, dp, max_tokens, pad_token_id, layout)

    def loss_fn(model, item):
        batch, real = item
        nll, correct, count = token_sums(model, {k: v.to(dp.device) for k, v in batch.items()})
        weight = 1.0 if real else 0.0  # a stand-in runs the forward (FSDP collectives) and adds nothing
        return nll * weight * dp.size / global_tokens, {"nll": nll.detach() * weight, "correct": correct * weight}

    metrics = trainable.forward_backward(batches, loss_fn)
    lr = trainable.current_lr()
    grad_norm = trainable.step()
    nll, correct = dp.sum([sum(metrics["nll"]), sum(metrics["correct"])])
    mine = [batch for batch, real in batches if real]
    grid = sum((batch["packed_input_ids"] if "packed_index" in batch else batch["input_ids"]).numel() for batch in mine)
    real_tokens = sum(int(batch["attention_mask"].sum()) for batch in mine)
    return {"train/loss": nll / global_tokens, "train/token_accuracy": correct / global_tokens,
            "train/tokens": global_tokens, "train/grad_norm": grad_norm, "train/lr": lr,
            "perf/padding_fraction": 1.0 - real_tokens / max(grid, 1)}  # this rank's


@torch.no_grad()
def heldout_metrics(model, examples: list[SFTExample], dp: DataParallel, max_tokens: int,
                    pad_token_id: int, layout: str | None = None) -> dict[str, float]:
    """Loss and token accuracy over held-out rows, every rank scoring its share."""
    model.eval()
    nll = correct = count = 0.0
    for batch, real in micro_batches(examples, dp, max_tokens, pad_token_id, layout):
        n, c, k = token_sums(model, {key: v.to(dp.device) for key, v in batch.items()})
        if real:
            nll, correct, count = nll + float(n), correct + float(c), count + float(k)
    nll, correct, count = dp.sum([nll, correct, count])
    return {"eval/loss": nll / count, "eval/token_accuracy": correct / count}


def generation_accuracy(model, examples: list[SFTExample], reward_fn: Callable, tokenizer, dp: DataParallel,
                        max_new_tokens: int) -> dict[str, float]:
    """Greedy completions of the held-out prompts scored by `reward_fn(completion, row)`: eval/accuracy
    (score > 0) and eval/reward_mean. Every rank decodes an equal share (padded with repeats)."""
    per_rank = -(-len(examples) // dp.size)
    share = examples[dp.rank * per_rank:(dp.rank + 1) * per_rank]
    padded = share + [examples[0]] * (per_rank - len(share))  # same batches on every rank; not counted
    prompts = [e.input_ids[:e.prompt_length] for e in padded]
    model.eval()
    completions = decode(model, prompts, max_new_tokens, tokenizer.eos_token_id, tokenizer.pad_token_id, dp.device)
    correct = total = 0.0
    for example, ids in zip(share, completions):
        score = reward_fn(tokenizer.decode(ids, skip_special_tokens=True), example.row)
        if inspect.isawaitable(score):
            score = asyncio.run(score)
        correct, total = correct + float(score > 0), total + float(score)
    correct, total = dp.sum([correct, total])
    return {"eval/accuracy": correct / len(examples), "eval/reward_mean": total / len(examples)}
