"""Supervised fine-tuning: `torchrun --nproc_per_node N -m rl_core.train_sft --config sft_arithmetic.yaml [key=value ...]`.

Chat (`messages`) or prompt/response rows, the loss on the assistant (response) tokens only, a
mean over every trained token of the step. Same worker as the RL jobs (FSDP2, token-balanced
micro-batches), same config machinery, checkpoints (`trainer.save_every`, `trainer.resume=auto`),
metrics (`metrics.jsonl`, TensorBoard, wandb) and Hugging Face export (`<run_dir>/final`).
Evaluation (step 0, every `eval.every` steps, the end): held-out loss and token accuracy, and with
`eval.reward_fn` the accuracy of greedy completions.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from rl_core.checkpoint import Checkpointer
from rl_core.cli import parse_job_config, run_main
from rl_core.config import save_config, to_dict
from rl_core.distributed import (DataParallel, device_for_rank, init_distributed, on_every_rank, on_rank0,
                                 prepare_before_process_group, seed_everything)
from rl_core.logger import MetricsLogger
from rl_core.optim import build_optimizer, linear_anneal_schedule
from rl_core.rewards import load_reward_fn
from rl_core.run_dir import RunDirLock
from rl_core.sft.config import SFTConfig, validate
from rl_core.sft.data import SFTDataError, encode_rows, load_rows
from rl_core.sft.training import generation_accuracy, heldout_metrics, train_step
from workers import models
from workers.fsdp import TrainableModel, full_state_dict, shard_model


def main(argv: list[str] | None = None, prepare=None) -> None:
    """`prepare(cfg, log)` (the entry point's: offline data named in the recipe) runs on every rank
    before the process group exists."""
    run_main(lambda args: _main(args, prepare), argv, stop_hint="trainer.resume=auto continues from the last checkpoint")


def _main(argv: list[str] | None, prepare) -> None:
    cfg = parse_job_config(argv, __doc__, "sft_arithmetic.yaml", SFTConfig, validate)
    if prepare is not None:
        cfg = prepare_before_process_group(lambda log: prepare(cfg, log), "prepare the offline assets")
    rank, world_size = init_distributed(timeout_s=cfg.trainer.collective_timeout_s)
    lock = None
    try:
        lock = on_rank0(lambda: RunDirLock(cfg.trainer.run_dir).acquire())  # one live job per run directory
        train(cfg, DataParallel(rank, world_size, sharded=True, device=device_for_rank()))
    finally:
        dist.destroy_process_group()
        if lock is not None:
            lock.release()


def train(cfg: SFTConfig, dp: DataParallel) -> None:
    tr, run_dir = cfg.train, Path(cfg.trainer.run_dir)
    reward_fn = load_reward_fn(cfg.eval.reward_fn) if cfg.eval.reward_fn else None
    on_every_rank(lambda: models.check_model_path(cfg.model.path, "model.path"))
    tokenizer = models.load_tokenizer(cfg.model.tokenizer_path or cfg.model.path)
    train_rows, eval_rows = load_data(cfg, tokenizer, dp.rank)
    steps_per_epoch = len(train_rows) // tr.batch_size
    if steps_per_epoch < 1:
        raise SFTDataError(f"{cfg.data.train_path} has {len(train_rows)} usable rows, fewer than one batch "
                           f"(train.batch_size={tr.batch_size}); lower train.batch_size or add rows")
    total_steps = min(tr.max_steps or sys.maxsize, tr.epochs * steps_per_epoch)
    seed_everything(cfg.trainer.seed)  # the same initial weights on every rank
    model = models.load_causal_lm(cfg.model.path)
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))  # a [PAD] the tokenizer gained
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    shard_model(model.to(dp.device), mixed_precision=cfg.model.mixed_precision)
    schedule = (lambda opt: linear_anneal_schedule(opt, total_steps, tr.warmup_steps)) if tr.schedule == "linear" else (
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, tr.warmup_steps))))
    trainable = TrainableModel(
        model, lambda m: build_optimizer(m.parameters(), tr.optimizer, tr.lr, eps=tr.adam_eps,
                                         weight_decay=tr.weight_decay, betas=tuple(tr.adam_betas)),
        schedule, max_grad_norm=tr.max_grad_norm)
    checkpointer = Checkpointer(run_dir / "checkpoints", dp.rank, keep_last=cfg.trainer.keep_last)
    start_step, _ = checkpointer.maybe_resume(cfg.trainer.resume, {"model": trainable})
    logger = None
    if dp.rank == 0:
        logger = MetricsLogger(run_dir, to_dict(cfg), cfg.trainer.wandb, cfg.trainer.wandb_project,
                               resume_step=start_step)
        save_config(cfg, run_dir / "config.yaml")
        print(f"[sft] {len(train_rows)} rows, {total_steps} steps of {tr.batch_size} on {dp.size} rank(s)", flush=True)

    def evaluate() -> dict[str, float]:
        metrics = heldout_metrics(model, eval_rows, dp, tr.max_tokens_per_device, tokenizer.pad_token_id)
        if reward_fn is not None:
            metrics.update(generation_accuracy(model, eval_rows[:cfg.eval.generate_rows], reward_fn, tokenizer, dp,
                                               cfg.eval.max_new_tokens))
        return metrics

    if eval_rows and start_step == 0:
        log_step(logger, 0, total_steps, evaluate())
    for step in range(start_step, total_steps):
        started = time.perf_counter()
        metrics = train_step(trainable, step_rows(train_rows, step, tr.batch_size, cfg.trainer.seed), dp,
                             tr.max_tokens_per_device, tokenizer.pad_token_id)
        metrics.update({"perf/step_s": time.perf_counter() - started, "epoch": step / steps_per_epoch})
        if eval_rows and (step + 1 == total_steps or (cfg.eval.every and (step + 1) % cfg.eval.every == 0)):
            metrics.update(evaluate())
        log_step(logger, step + 1, total_steps, metrics, every=tr.log_every)
        if cfg.trainer.save_every and (step + 1) % cfg.trainer.save_every == 0:
            checkpointer.save(step + 1, {"model": trainable}, {})
    if cfg.trainer.export_hf:
        export(model, tokenizer, cfg.model.path, run_dir / "final", dp.rank)
    if logger is not None:
        logger.close()


def load_data(cfg: SFTConfig, tokenizer, rank: int):
    """Every rank tokenizes the rows (each step needs the whole batch's lengths); rank 0 reports."""
    train_rows, too_long = encode_rows(load_rows(cfg.data.train_path), tokenizer, cfg.data, cfg.data.train_path)
    eval_rows = []
    if cfg.data.eval_path is not None:
        eval_rows, _ = encode_rows(load_rows(cfg.data.eval_path), tokenizer, cfg.data, cfg.data.eval_path)
        eval_rows = eval_rows[:cfg.data.eval_max_rows]
    if rank == 0 and too_long:
        print(f"[sft] {too_long} rows longer than data.max_length={cfg.data.max_length} were "
              f"{'left out' if cfg.data.on_long == 'drop' else 'cut'}", flush=True)
    return train_rows, eval_rows


def step_rows(rows: list, step: int, batch_size: int, seed: int) -> list:
    """The rows of global step `step`: epochs are seeded shuffles, so a resumed run sees the same batches."""
    per_epoch = len(rows) // batch_size
    epoch, offset = divmod(step, per_epoch)
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    return [rows[i] for i in order[offset * batch_size:(offset + 1) * batch_size]]


def log_step(logger: MetricsLogger | None, step: int, total: int, metrics: dict, every: int = 1) -> None:
    if logger is None:
        return
    logger.log(step, metrics)
    if step == 0 or step == total or step % every == 0 or "eval/loss" in metrics:
        shown = "  ".join(f"{key}={metrics[key]:.4g}" for key in ("train/loss", "train/token_accuracy", "eval/loss",
                                                                   "eval/token_accuracy", "eval/accuracy", "perf/step_s")
                          if key in metrics)
        print(f"step {step}/{total}  {shown}", flush=True)


def export(model, tokenizer, base_path: str, out_dir: Path, rank: int) -> None:
    """The fine-tuned model in Hugging Face format (save_pretrained + tokenizer, its chat template included)."""
    state = full_state_dict(model)  # collective: every rank gathers
    if rank != 0:
        return
    plain = models.load_causal_lm(base_path)
    if len(tokenizer) > plain.get_input_embeddings().num_embeddings:
        plain.resize_token_embeddings(len(tokenizer))
    plain.load_state_dict(state)
    plain.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    print(f"final model saved to {out_dir}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
