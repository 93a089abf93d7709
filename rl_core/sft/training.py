"""SFT's loss on the one batch worker (`workers.worker`): the mean over every trained token of the
global batch, whatever the split across ranks and micro-batches (the worker scales each rank's
token sum by `dp_size` / the global token count)."""

from __future__ import annotations

import asyncio
import inspect
from typing import Callable

import torch

from rl_core.distributed import DataParallel
from rl_core.sft.data import SFTExample
from workers.decode import DecodeSettings, decode
from workers.forward import host_view, token_logprobs_and_hits
from workers.layout import grid_tokens, rows_to_batch
from workers.read_back import read_back
from workers.worker import BatchWorker


def collate(examples: list[SFTExample], pad_token_id: int) -> dict[str, torch.Tensor]:
    """The step's `[N, T]` batch: `action_mask` marks the trained tokens."""
    return rows_to_batch([{"input_ids": e.input_ids, "action_mask": e.loss_mask} for e in examples], pad_token_id)


def token_sums(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(negative log-likelihood summed over trained tokens, how many the argmax got right, how many)."""
    logprobs, hits = token_logprobs_and_hits(model, batch)  # about each trained token (0 elsewhere)
    mask = batch["action_mask"][:, 1:].to(logprobs.device).float()  # a first token is never predicted
    logprobs, hits = logprobs[:, 1:], hits[:, 1:]
    return -(logprobs * mask).sum(), (hits * mask).sum().detach(), mask.sum()


def train_step(trainable, worker: BatchWorker, examples: list[SFTExample], pad_token_id: int) -> dict[str, float]:
    """One optimizer step on `examples` (every rank passes the same rows); returns global metrics."""
    batch = collate(examples, pad_token_id)
    global_tokens = float(batch["action_mask"][:, 1:].sum())

    def loss_fn(model, micro_batch):
        nll, correct, _ = token_sums(model, micro_batch)
        return nll, {"nll": nll.detach(), "correct": correct}

    metrics, micro = worker.forward_backward(trainable, batch, loss_fn, global_tokens)
    lr = trainable.current_lr()
    metrics = read_back({**metrics, "grad_norm": [trainable.step()]})  # the step's one read from the device
    grad_norm = metrics["grad_norm"][0]
    nll, correct = worker.sum_over_ranks([sum(metrics["nll"]), sum(metrics["correct"])])
    micro = [host_view(b) for b in micro]  # the layout's sizes, counted on the host
    grid = sum(grid_tokens(b) for b in micro)
    real_tokens = sum(int(b["attention_mask"].sum()) for b in micro)
    return {"train/loss": nll / global_tokens, "train/token_accuracy": correct / global_tokens,
            "train/tokens": global_tokens, "train/grad_norm": grad_norm, "train/lr": lr,
            "perf/padding_fraction": 1.0 - real_tokens / max(grid, 1)}  # this rank's


def heldout_metrics(model, worker: BatchWorker, examples: list[SFTExample], pad_token_id: int) -> dict[str, float]:
    """Loss and token accuracy over held-out rows, every rank scoring its share."""
    model.eval()
    nll, correct, count = worker.sums(collate(examples, pad_token_id), lambda b: token_sums(model, b))
    return {"eval/loss": nll / count, "eval/token_accuracy": correct / count}


def generation_accuracy(model, examples: list[SFTExample], reward_fn: Callable, tokenizer, dp: DataParallel,
                        max_new_tokens: int) -> dict[str, float]:
    """Greedy completions of the held-out prompts scored by `reward_fn(completion, row)`: eval/accuracy
    (score > 0) and eval/reward_mean. Every rank decodes an equal share (padded with repeats)."""
    share, padded = dp.share(examples)  # padded: the same batches on every rank, the repeats not counted
    prompts = [e.input_ids[:e.prompt_length] for e in padded]
    model.eval()
    completions = decode(model, prompts, DecodeSettings(max_new_tokens, tokenizer.eos_token_id), tokenizer.pad_token_id,
                         dp.device)
    correct = total = 0.0
    for example, ids in zip(share, completions):
        score = reward_fn(tokenizer.decode(ids, skip_special_tokens=True), example.row)
        if inspect.isawaitable(score):
            score = asyncio.run(score)
        correct, total = correct + float(score > 0), total + float(score)
    correct, total = dp.sum([correct, total])
    return {"eval/accuracy": correct / len(examples), "eval/reward_mean": total / len(examples)}
