"""The PPO job: `torchrun --nproc_per_node N -m rl_core.train --config ppo_sentiment.yaml [key=value ...]`.

Every rank trains with FSDP2 and owns an inference engine; rank 0 also runs the router and the
environments. One step (design.md): rollout through the router -> reference logprobs, values,
reward-model scores and old logprobs on balanced micro-batches -> advantages -> PPO epochs ->
weights pushed into every engine. `trainer.mode=async` overlaps rollout with training.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from envs.base import load_env_class
from rl_core import algorithms as alg
from rl_core.balance import balanced_partitions, minibatch_indices, partitions_for_rank
from rl_core.checkpoint import Checkpointer
from rl_core.cli import parse_job_config
from rl_core.config import JobConfig, check_context_length, save_config, to_dict
from rl_core.experience import Experience, compute_advantages, reward_model_inputs
from rl_core.optim import build_optimizer, linear_anneal_schedule
from rl_core.logger import MetricsLogger
from rl_core.runtime import JobRuntime, print_step, sample_rows
from workers import models
from workers.engines.client import EngineError
from workers.fsdp import TrainableModel, full_state_dict, rank_seed, seed_everything, shard_model


class PPOTrainer:
    """The models of one rank and the step that updates them."""

    def __init__(self, cfg: JobConfig, rt: JobRuntime, policy_path: str, reward_path: str | None, total_steps: int):
        self.cfg, self.rt = cfg, rt
        alg_cfg, model_cfg = cfg.algorithm, cfg.model
        dtype = getattr(torch, model_cfg.dtype)
        self.tokenizer = rt.tokenizer
        vocab = len(self.tokenizer)
        shard = dict(mixed_precision=model_cfg.mixed_precision, cpu_offload=model_cfg.cpu_offload)
        # The schedule counts optimizer steps: epochs x minibatches of every PPO step (OpenAI anneals to zero).
        optimizer_steps = total_steps * alg_cfg.noptepochs * alg_cfg.nminibatches
        schedule = (lambda opt: linear_anneal_schedule(opt, optimizer_steps)) if alg_cfg.anneal_lr else None

        def optimizer_for(lr):
            return lambda m: build_optimizer(m.parameters(), alg_cfg.optimizer, lr=lr, eps=alg_cfg.adam_eps,
                                             weight_decay=alg_cfg.weight_decay)

        policy = shard_model(models.load_causal_lm(policy_path, dtype, vocab_size=vocab), **shard)
        self.actor = TrainableModel(policy, optimizer_for(alg_cfg.lr), schedule, alg_cfg.max_grad_norm)
        self.reference = shard_model(models.load_causal_lm(policy_path, dtype, vocab_size=vocab), **shard)
        self.reference.requires_grad_(False)
        self.critic = None
        if alg_cfg.advantage_estimator == "gae":
            critic = shard_model(models.ValueModel.from_pretrained(policy_path, dtype, vocab_size=vocab), **shard)
            self.critic = TrainableModel(critic, optimizer_for(alg_cfg.critic_lr or alg_cfg.lr), schedule,
                                         alg_cfg.max_grad_norm)
        self.reward_model = None
        if reward_path is not None:
            rm = models.load_reward_model(reward_path, dtype, pad_token_id=self.tokenizer.pad_token_id)
            self.reward_model = shard_model(rm, **shard)
            self.reward_model.requires_grad_(False)
        self.kl_ctl = (alg.AdaptiveKLController(alg_cfg.kl.init_coef, alg_cfg.kl.target, alg_cfg.kl.horizon)
                       if alg_cfg.kl.adaptive else alg.FixedKLController(alg_cfg.kl.init_coef))
        self.truncate_id = self._truncate_token_id()

    def _truncate_token_id(self) -> int | None:
        token = self.cfg.reward.truncate_token
        if token is None or self.reward_model is None:
            return None
        return models.single_token_id(self.tokenizer, token, "reward.truncate_token")

    # ------------------------------------------------------------------ distributed helpers

    def _my_micro_batches(self, lengths: list[int]) -> list[list[int]]:
        partitions = balanced_partitions(lengths, self.rt.world_size, self.cfg.algorithm.max_tokens_per_device)
        return partitions_for_rank(partitions, self.rt.rank, self.rt.world_size)

    def _collate(self, rows: list[dict], indices: list[int]) -> dict[str, torch.Tensor]:
        """A micro-batch on this rank's device. An empty partition (fewer sequences than
        partitions) becomes one masked-out token: FSDP forwards are collectives, so every rank
        must run the same number of them."""
        if indices:
            chosen = [rows[i] for i in indices]
        else:
            chosen = [{k: v[:1] for k, v in rows[0].items()}]
            chosen[0]["action_mask"] = [0]
        return self.rt.to_device(models.make_micro_batch(chosen, self.tokenizer.pad_token_id))

    def _distributed_map(self, rows: list[dict], fn) -> list:
        """Apply `fn(micro_batch) -> per-row results` over this rank's balanced share; gather everywhere."""
        mine = {}
        for indices in self._my_micro_batches([len(r["input_ids"]) for r in rows]):
            with torch.no_grad():
                outputs = fn(self._collate(rows, indices))
            for i, out in zip(indices, outputs):
                mine[i] = out
        gathered = [None] * self.rt.world_size
        dist.all_gather_object(gathered, mine)
        merged = {k: v for part in gathered for k, v in part.items()}
        return [merged[i] for i in range(len(rows))]

    # ------------------------------------------------------------------ scoring (forward only)

    def score(self, exp: Experience) -> dict[str, float]:
        """Old/ref logprobs, values and reward-model scores, each on balanced micro-batches."""
        temperature = self.cfg.rollout.temperature
        rows = [exp.seq_row(i) for i in range(len(exp.sequences))]

        def forward(batch):
            lengths = batch["attention_mask"].sum(dim=1).tolist()
            old = models.token_logprobs(self.actor.model, batch, temperature).float().cpu()
            ref = models.token_logprobs(self.reference, batch, temperature).float().cpu()
            values = (models.token_values(self.critic.model, batch).float().cpu() if self.critic is not None
                      else torch.zeros_like(old))
            return [(old[j, :n], ref[j, :n], values[j, :n]) for j, n in enumerate(lengths)]

        results = self._distributed_map(rows, forward)
        exp.old_logprobs = [r[0] for r in results]
        exp.ref_logprobs = [r[1] for r in results]
        exp.values = [r[2] for r in results]

        n_traj = len(exp.trajectories)
        scores = torch.zeros(n_traj)
        rejected = torch.zeros(n_traj, dtype=torch.bool)
        if self.reward_model is not None:
            rm_ids, rejected = reward_model_inputs(exp.trajectories, self.truncate_id, self.cfg.reward.truncate_after)
            rm_rows = [{"input_ids": ids, "action_mask": [0] * len(ids)} for ids in rm_ids]

            def rm_forward(batch):
                return models.reward_scores(self.reward_model, batch["input_ids"], batch["attention_mask"],
                                            batch["position_ids"]).float().cpu()

            scores = torch.stack(self._distributed_map(rm_rows, rm_forward))
        exp.raw_scores = scores.clone()
        # OpenAI rejection sampling: no period after token `truncate_after` -> fixed penalty.
        exp.scores = torch.where(rejected, torch.full_like(scores, self.cfg.reward.penalty), scores)
        behaviour_gap = [(o - s_b).abs()[m] for o, s_b, m in (
            (exp.old_logprobs[i], torch.tensor(s.behaviour_logprobs), torch.tensor(s.action_mask, dtype=torch.bool))
            for i, s in enumerate(exp.sequences))]
        gap = torch.cat(behaviour_gap) if behaviour_gap else torch.zeros(1)
        return {"reward/score_mean": exp.raw_scores.mean().item(),
                "reward/score_std": exp.raw_scores.std().item() if n_traj > 1 else 0.0,
                "reward/rejected_frac": rejected.float().mean().item(),
                "reward/env_mean": sum(t.env_reward for t in exp.trajectories) / max(n_traj, 1),
                "rollout/behaviour_logprob_gap": gap.mean().item() if gap.numel() else 0.0}

    # ------------------------------------------------------------------ PPO update

    def update(self, exp: Experience, step: int) -> dict[str, float]:
        cfg = self.cfg.algorithm
        n_traj = len(exp.trajectories)
        adv_kwargs = dict(gamma=cfg.gamma, lam=cfg.lam, kl_estimator=cfg.kl.estimator,
                          whiten_rewards=cfg.whiten_rewards, estimator=cfg.advantage_estimator,
                          group_size=cfg.group_size)
        kl_coef = self.kl_ctl.value
        stats = compute_advantages(exp, list(range(n_traj)), kl_coef, **adv_kwargs)
        # Same permutation on every rank: ranks must agree on each minibatch's contents.
        generator = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step)
        history: dict[str, list[float]] = {}
        for _epoch in range(cfg.noptepochs):
            for minibatch in minibatch_indices(n_traj, cfg.nminibatches, generator):
                if cfg.nminibatches > 1:  # OpenAI whitens per minibatch; with one minibatch once is enough
                    compute_advantages(exp, minibatch, kl_coef, **adv_kwargs)
                for key, value in self._train_minibatch(exp, minibatch).items():
                    history.setdefault(key, []).append(value)
        # Adaptive KL (OpenAI): steer the per-episode KL of this batch towards the target.
        self.kl_ctl.update(stats["kl/mean"], n_traj)
        out = {k: sum(v) / len(v) for k, v in history.items()}
        out.update(stats)
        out["kl/coef"] = kl_coef
        out["policy/lr"] = self.actor.current_lr()
        return out

    def _train_minibatch(self, exp: Experience, traj_ids: list[int]) -> dict[str, float]:
        cfg = self.cfg.algorithm
        seq_ids = [s for t in traj_ids for s in exp.traj_seqs[t]]
        keys = ("old_logprobs", "advantages", "returns", "values", "behaviour_logprobs")
        rows = [exp.seq_row(s, *keys) for s in seq_ids]
        masks = [torch.tensor(r["action_mask"]) for r in rows]
        # Loss scaling: every rank divides by the *global* count of this minibatch (all ranks see it).
        denominator = sum(alg.global_denominator(m[None], cfg.loss_agg).item() for m in masks)
        micro = [self._collate(rows, idx) for idx in self._my_micro_batches([len(r["input_ids"]) for r in rows])]
        dp = self.rt.world_size
        async_correction = self.cfg.trainer.mode == "async"

        def policy_loss_fn(model, batch):
            logprobs, entropy = models.token_logprobs_and_entropy(model, batch, self.cfg.rollout.temperature,
                                                                  entropy_grad=bool(cfg.entropy_coef))
            mask = batch["action_mask"]
            weights = (alg.truncated_importance_weights(batch["old_logprobs"], batch["behaviour_logprobs"],
                                                        cfg.behaviour_is_cap) if async_correction else None)
            per_token, stats = alg.policy_loss(logprobs, batch["old_logprobs"], batch["advantages"], mask,
                                               cfg.cliprange, behaviour_weights=weights)
            loss = alg.aggregate_loss(per_token, mask, cfg.loss_agg, denominator, dp)
            entropy_term = alg.aggregate_loss(entropy, mask, cfg.loss_agg, denominator, dp)
            if cfg.entropy_coef:
                loss = loss - cfg.entropy_coef * entropy_term
            return loss, {"policy/clipfrac": stats["clipfrac"], "policy/approx_kl": stats["approx_kl"],
                          "policy/entropy": alg.masked_mean(entropy.detach(), mask)}

        def value_loss_fn(model, batch):
            values = models.token_values(model, batch)
            mask = batch["action_mask"]
            per_token, stats = alg.value_loss(values, batch["values"], batch["returns"], mask, cfg.cliprange_value)
            loss = cfg.vf_coef * alg.aggregate_loss(per_token, mask, cfg.loss_agg, denominator, dp)
            return loss, {"value/vf_clipfrac": stats["vf_clipfrac"],
                          "value/loss": alg.masked_mean(per_token.detach(), mask)}

        metrics = self.actor.forward_backward(micro, policy_loss_fn)
        out = {k: sum(v) / len(v) for k, v in metrics.items() if k != "loss"}
        out["perf/padding_fraction"] = sum(models.padding_fraction(b) for b in micro) / len(micro)
        out["policy/loss"] = sum(metrics["loss"])
        out["policy/grad_norm"] = self.actor.step()
        if self.critic is not None:
            metrics = self.critic.forward_backward(micro, value_loss_fn)
            out.update({k: sum(v) / len(v) for k, v in metrics.items() if k != "loss"})
            out["value/grad_norm"] = self.critic.step()
        return out


def main(argv: list[str] | None = None) -> None:
    cfg = parse_job_config(argv, __doc__, "ppo_sentiment.yaml")
    # torchrun stops workers with SIGTERM: turn it into SystemExit so every `finally` runs.
    signal.signal(signal.SIGTERM, lambda signum, frame: (_ for _ in ()).throw(SystemExit(128 + signum)))
    with JobRuntime(cfg) as rt:
        train(cfg, rt)


def train(cfg: JobConfig, rt: JobRuntime) -> None:
    load_env_class(cfg.env.cls)  # a wrong import path fails here, before any engine starts
    rt.resolve_assets()
    check_context_length(cfg, rt.max_positions)
    seed_everything(rank_seed(cfg.seed, rt.rank))
    run_dir = Path(cfg.trainer.run_dir)
    batch_size = cfg.algorithm.batch_size
    total_steps = cfg.trainer.total_episodes // batch_size
    rt.start_engines(rt.policy_path)
    trainer = PPOTrainer(cfg, rt, rt.policy_path, rt.reward_path, total_steps)
    checkpointer = Checkpointer(run_dir / "checkpoints", rt.rank)
    prompts = rt.prompt_batches(batch_size, cfg.algorithm.group_size) if rt.rank == 0 else None
    start_step = checkpointer.maybe_resume(cfg.trainer.resume, trainer, prompts)
    logger = MetricsLogger(run_dir, to_dict(cfg), cfg.trainer.wandb, cfg.trainer.wandb_project) if rt.rank == 0 else None
    if rt.rank == 0:
        save_config(cfg, run_dir / "config.yaml")

    version = start_step
    rt.sync_weights(full_state_dict(trainer.actor.model), version)
    service = rt.start_rollout_service() if rt.rank == 0 else None
    if service is not None and cfg.trainer.mode == "async":
        service.start_producer(prompts, lambda: rt.engine_version, cfg.async_.queue_batches)

    for step in range(start_step, total_steps):
        step_start = time.perf_counter()
        trajectories, rollout_metrics = None, {}
        if rt.rank == 0:
            try:
                if cfg.trainer.mode == "sync":
                    result, dropped = service.collect(next(prompts), version), 0
                else:
                    result, dropped = service.next_batch(batch_size, version, cfg.async_.max_staleness)
            except EngineError as err:
                dead = rt.dead_engines()
                raise RuntimeError(f"rollout failed: {'; '.join(dead) + ' stopped answering' if dead else err}"
                                   ) from err
            trajectories, rollout_metrics = result.trajectories, dict(result.metrics)
            rollout_metrics["async/dropped_stale"] = dropped
            rollout_metrics["async/staleness_max"] = max((version - t.min_version for t in trajectories), default=0)
        trajectories, rollout_metrics = rt.broadcast((trajectories, rollout_metrics))
        if not trajectories:
            raise RuntimeError("the rollout produced no usable trajectory (every env failed); see rank 0's log")
        rollout_s = time.perf_counter() - step_start

        t0 = time.perf_counter()
        rt.release_engine_memory()
        exp = Experience.from_trajectories(trajectories)
        metrics = trainer.score(exp)
        infer_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        metrics.update(trainer.update(exp, step))
        train_s = time.perf_counter() - t0

        t0 = time.perf_counter()
        version = step + 1
        rt.sync_weights(full_state_dict(trainer.actor.model), version)
        sync_s = time.perf_counter() - t0
        if cfg.trainer.save_every and (step + 1) % cfg.trainer.save_every == 0:
            # Async: the position after the last batch trained on, not the producer's, which runs ahead.
            data_state = None if rt.rank != 0 else (
                prompts.state_dict() if cfg.trainer.mode == "sync" else service.resume_state)
            checkpointer.save(step + 1, trainer, data_state)

        step_s = time.perf_counter() - step_start
        if rt.rank == 0:
            tokens = sum(t.num_tokens for t in trajectories)
            metrics.update(rollout_metrics)
            metrics.update({"perf/rollout_s": rollout_s, "perf/inference_s": infer_s, "perf/train_s": train_s,
                            "perf/sync_s": sync_s, "perf/step_s": step_s, "perf/tokens_per_s": tokens / step_s,
                            "perf/episodes_per_s": len(trajectories) / step_s,
                            "episodes": (step + 1) * batch_size})
            logger.log(step + 1, metrics)
            print_step(step + 1, total_steps, metrics)
            if cfg.trainer.log_samples_every and (step % cfg.trainer.log_samples_every == 0 or step + 1 == total_steps):
                logger.log_samples(step + 1, sample_rows(rt.tokenizer, exp, n=4))

    final_state = full_state_dict(trainer.actor.model)
    if cfg.trainer.export_hf:
        rt.export_policy(final_state, run_dir / "final")
    if logger is not None:
        logger.close()


if __name__ == "__main__":
    main(sys.argv[1:])
