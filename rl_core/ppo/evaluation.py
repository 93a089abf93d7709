"""Evaluation on held-out prompts: sampling settings, accuracy, pass@k and a table of samples.

The job generates the eval samples through the same rollout (router, envs, reward functions)
with the `eval` sampling settings (greedy by default) at step 0, every `eval.every`
steps and at the end; this module turns those trajectories into `eval/*` metrics.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable
from math import comb

import torch

from rl_core.distributed import broadcast_object, wait_for_rank0
from rl_core.ppo.config import PPOConfig, sampling_params
from rl_core.ppo.scoring import Scoring, trajectory_scores
from rl_core.rollout.trajectory import Trajectory


def eval_sampling_params(cfg: PPOConfig) -> dict:
    ev = cfg.eval
    return sampling_params(cfg.rollout, max_new_tokens=ev.response_length or cfg.rollout.response_length,
                           temperature=ev.temperature, top_p=ev.top_p, top_k=-1)


def pass_at_k(n: int, correct: int, k: int) -> float:
    """Unbiased pass@k from n samples of which `correct` are right (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= correct <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= correct <= n and 1 <= k <= n, got n={n}, correct={correct}, k={k}")
    return 1.0 - comb(n - correct, k) / comb(n, k)


def accuracy_fn(cfg: PPOConfig) -> str | None:
    """The reward component that marks a correct answer: eval.accuracy_fn, else the first reward function."""
    return cfg.eval.accuracy_fn or next(iter(cfg.reward.fns), None)


def eval_metrics(cfg: PPOConfig, samples: list[dict], trajectories: list[Trajectory], scores: torch.Tensor,
                 skipped_prompts: int) -> dict[str, float]:
    """`eval/*` metrics. `scores`: each trajectory's total reward. A sample whose trajectory failed
    counts as wrong, with reward 0, so a flaky env cannot raise the accuracy."""
    n_samples, n = len(samples), cfg.eval.n
    metrics = {"eval/reward_mean": float(scores.sum()) / n_samples, "eval/prompts": n_samples // n,
               "eval/failed": n_samples - len(trajectories), "eval/prompts_skipped_long": skipped_prompts}
    if trajectories:
        lengths = [len(t.final_response()[1]) for t in trajectories]
        metrics["eval/response_length_mean"] = sum(lengths) / len(lengths)
        metrics["eval/truncated_frac"] = sum(t.truncated for t in trajectories) / len(trajectories)
    for name in cfg.reward.fns:
        metrics[f"eval/fn/{name}"] = sum(t.reward_components.get(name, 0.0) for t in trajectories) / n_samples
    key = accuracy_fn(cfg)
    if key is None:
        return metrics
    correct = defaultdict(int)
    for traj in trajectories:
        correct[traj.sample["group_id"]] += traj.reward_components.get(key, 0.0) > 0
    metrics["eval/accuracy"] = sum(correct.values()) / n_samples
    prompts = {s["group_id"] for s in samples}
    k = 1
    while k <= n:  # pass@1, pass@2, pass@4, ... and pass@n
        metrics[f"eval/pass@{k}"] = sum(pass_at_k(n, correct[p], k) for p in prompts) / len(prompts)
        k = k * 2 if k * 2 <= n or k == n else n
    return metrics


def eval_rows(cfg: PPOConfig, tokenizer, trajectories: list[Trajectory], scores: torch.Tensor, limit: int) -> list[dict]:
    """The first `limit` eval samples as table rows: prompt, response, reference answer, reward, correct."""
    key = accuracy_fn(cfg)
    rows = []
    for traj, score in list(zip(trajectories, scores.tolist()))[:limit]:
        context, response = traj.final_response()
        row = {"query": tokenizer.decode(context, skip_special_tokens=True),
               "response": tokenizer.decode(response, skip_special_tokens=True), "score": score}
        if "answer" in traj.sample:
            row["answer"] = str(traj.sample["answer"])
        if key is not None:
            row["correct"] = bool(traj.reward_components.get(key, 0.0) > 0)
        rows.append(row)
    return rows


def evaluate(cfg: PPOConfig, rank: int, service, reward_model: Callable | None, tokenizer, held_out, version: int):
    """Generate on the held-out prompts (rank 0, eval sampling) and score them; returns (metrics, table
    rows) on rank 0. `reward_model(trajectories) -> (scores, rejected)` is a collective forward when there
    is one (None: no reward model), so then every rank joins."""
    trajectories = None
    if rank == 0:
        samples, _ = held_out
        trajectories = service.evaluate(samples, eval_sampling_params(cfg), version)[0]
    wait_for_rank0(f"evaluation at version {version}")  # held-out generation may outlast the collective timeout
    if reward_model is not None:
        trajectories = broadcast_object(trajectories)
        rm_scores, rejected = reward_model(trajectories) if trajectories else (None, None)
    elif trajectories:
        rm_scores, rejected = torch.zeros(len(trajectories)), torch.zeros(len(trajectories), dtype=torch.bool)
    if rank != 0:
        return {}, []
    samples, skipped = held_out
    scores = torch.zeros(0)
    if trajectories:  # the training score (penalties and shaping included), plus the env's rewards
        scoring = Scoring.from_config(cfg.reward, cfg.algorithm, cfg.eval.response_length or cfg.rollout.response_length)
        scores, _ = trajectory_scores(trajectories, rm_scores, rejected, scoring)
        scores = scores + torch.tensor([t.env_reward for t in trajectories], dtype=scores.dtype)
    metrics = eval_metrics(cfg, samples, trajectories, scores, skipped)
    return metrics, eval_rows(cfg, tokenizer, trajectories, scores, cfg.eval.log_samples)


def print_eval(step: int, metrics: dict) -> None:
    shown = "  ".join(f"{k.split('/', 1)[1]}={v:.3f}" for k, v in metrics.items()
                      if k in ("eval/accuracy", "eval/reward_mean") or k.startswith("eval/pass@"))
    print(f"eval at step {step}: {shown}", flush=True)
