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
from workers.models import decode, logprobs_from_logits, make_micro_batch, prepare_inputs


def collate(examples: list[SFTExample], pad_token_id: int, packed: bool = False) -> dict[str, torch.Tensor]:
    """Padded rows, or (`packed`) the sequences back to back in as few rows as hold them, each row as
    long as the longest sequence (first fit, longest first): positions restart at each sequence and
    `segment_ids` keep attention inside it (see `packed_inputs`). Rows as long as a sequence keep
    attention's cost that of the padded layout; only the padding goes."""
    if not packed:
        rows = [{"input_ids": e.input_ids, "action_mask": e.loss_mask} for e in examples]
        return make_micro_batch(rows, pad_token_id)
    width = max(len(e.input_ids) for e in examples)
    bins: list[list[SFTExample]] = []
    for example in sorted(examples, key=lambda e: -len(e.input_ids)):
        fits = next((b for b in bins if sum(len(e.input_ids) for e in b) + len(example.input_ids) <= width), None)
        bins.append([example]) if fits is None else fits.append(example)
    used = max(sum(len(e.input_ids) for e in b) for b in bins)
    batch = {key: torch.full((len(bins), used), fill, dtype=torch.long)
             for key, fill in (("input_ids", pad_token_id), ("action_mask", 0), ("position_ids", 0), ("segment_ids", -1))}
    for row, members in enumerate(bins):
        start = 0
        for number, e in enumerate(members):
            span = slice(start, start + len(e.input_ids))
            batch["input_ids"][row, span] = torch.tensor(e.input_ids)
            batch["action_mask"][row, span] = torch.tensor([0] + e.loss_mask[1:])  # a first token is never predicted
            batch["position_ids"][row, span] = torch.arange(len(e.input_ids))
            batch["segment_ids"][row, span] = number
            start += len(e.input_ids)
    return batch


def packed_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Model inputs of packed rows: a block-diagonal causal mask (a token sees earlier tokens of its
    own sequence only; padding sees itself), exact with any attention kernel that takes a 4-D
    boolean mask (sdpa, eager)."""
    segments = batch["segment_ids"]
    length = segments.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segments.device).tril()
    same = segments[:, :, None] == segments[:, None, :]
    mask = causal[None] & same
    input_ids = batch["input_ids"].masked_fill(segments < 0, 0)  # pad ids never reach the embedding
    return {"input_ids": input_ids, "attention_mask": mask[:, None], "position_ids": batch["position_ids"]}


def token_sums(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(negative log-likelihood summed over trained tokens, how many the argmax got right, how many)."""
    inputs = packed_inputs(batch) if "segment_ids" in batch else prepare_inputs(batch)
    logits = model(**inputs).logits[:, :-1].float()
    labels = inputs["input_ids"][:, 1:]
    mask = batch["action_mask"][:, 1:].to(logits.device).float()
    nll = -(logprobs_from_logits(logits, labels) * mask).sum()
    correct = ((logits.argmax(-1) == labels).float() * mask).sum().detach()
    return nll, correct, mask.sum()


def micro_batches(examples: list[SFTExample], dp: DataParallel, max_tokens: int, pad_token_id: int,
                  packed: bool = False):
    """This rank's micro-batches of `examples` (the whole step's rows, the same list on every rank):
    (batch, real) pairs, the same count on every rank (a stand-in with `real` False when a rank has none).
    `max_tokens` bounds the padded size, or with `packed` the real tokens."""
    lengths = [len(e.input_ids) for e in examples]
    mine = micro_batches_for_rank(lengths, dp.rank, dp.size, max_tokens, packed)
    return [(collate([examples[i] for i in indices], pad_token_id, packed), real)
            for indices, real in with_stand_ins(mine)]


def train_step(trainable, examples: list[SFTExample], dp: DataParallel, max_tokens: int,
               pad_token_id: int, packed: bool = False) -> dict[str, float]:
    """One optimizer step on `examples` (every rank passes the same rows); returns global metrics."""
    global_tokens = sum(sum(e.loss_mask[1:]) for e in examples)
    batches = micro_batches(examples, dp, max_tokens, pad_token_id, packed)

    def loss_fn(model, item):
        batch, real = item
        nll, correct, count = token_sums(model, {k: v.to(dp.device) for k, v in batch.items()})
        weight = 1.0 if real else 0.0  # a stand-in runs the forward (FSDP collectives) and adds nothing
        return nll * weight * dp.size / global_tokens, {"nll": nll.detach() * weight, "correct": correct * weight}

    metrics = trainable.forward_backward(batches, loss_fn)
    lr = trainable.current_lr()
    grad_norm = trainable.step()
    nll, correct = dp.sum([sum(metrics["nll"]), sum(metrics["correct"])])
    grid = sum(batch["input_ids"].numel() for batch, real in batches if real)
    real_tokens = sum(int((batch["segment_ids"] >= 0).sum()) if "segment_ids" in batch
                      else int(batch["attention_mask"].sum()) for batch, real in batches if real)
    return {"train/loss": nll / global_tokens, "train/token_accuracy": correct / global_tokens,
            "train/tokens": global_tokens, "train/grad_norm": grad_norm, "train/lr": lr,
            "perf/padding_fraction": 1.0 - real_tokens / max(grid, 1)}  # this rank's


@torch.no_grad()
def heldout_metrics(model, examples: list[SFTExample], dp: DataParallel, max_tokens: int,
                    pad_token_id: int) -> dict[str, float]:
    """Loss and token accuracy over held-out rows, every rank scoring its share."""
    model.eval()
    nll = correct = count = 0.0
    for batch, real in micro_batches(examples, dp, max_tokens, pad_token_id):
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
