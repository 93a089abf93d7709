"""The models of one rank (actor, reference, critic, reward model) and what they compute for PPO.

Every rank holds the whole batch (`Experience`, `[N, T]` rows) and works on its balanced share
through the one batch worker (`workers.worker`): forward passes for scoring, then per minibatch a
gradient-accumulated update whose loss the worker scales (global count, x dp_size).
"""

from __future__ import annotations

import functools
from typing import Callable, Iterator

import torch

from workers.balance import minibatch_indices
from rl_core.distributed import metrics_over_ranks
from rl_core.optim import build_optimizer, linear_anneal_schedule
from rl_core.ppo import algorithms as alg
from rl_core.ppo.config import PPOConfig
from rl_core.ppo.experience import Experience, Targets, reward_model_inputs
from rl_core.rollout.trajectory import Trajectory
from workers import forward, layout, loading
from workers.fsdp import TrainableModel, iter_full_tensors, shard_model
from workers.lora import merged_weights, with_lora
from workers.worker import BatchWorker


class PPOTrainer:
    """Actor (+ critic) being trained, frozen reference and reward model, all FSDP2-sharded."""

    def __init__(self, cfg: PPOConfig, tokenizer, policy_path: str, reward_path: str | None, total_steps: int,
                 device: torch.device, rank: int, world_size: int):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.device, self.rank, self.world_size = device, rank, world_size
        algo, model_cfg = cfg.algorithm, cfg.model
        dtype = getattr(torch, model_cfg.dtype)
        attention = model_cfg.attn_implementation  # every model runs the same (packed) micro-batches
        # Every model runs the same micro-batches: balanced, length-sorted, packed when asked.
        self.worker = BatchWorker(rank, world_size, device, algo.max_tokens_per_device,
                                  layout.packing_layout(algo.packing, attention), algo.share_prompts)
        shard = functools.partial(shard_model, mixed_precision=model_cfg.mixed_precision,
                                  cpu_offload=model_cfg.cpu_offload)
        # The schedule counts optimizer steps: epochs x minibatches of every PPO step (OpenAI anneals to zero).
        optimizer_steps = total_steps * algo.noptepochs * algo.nminibatches
        schedule = (lambda opt: linear_anneal_schedule(opt, optimizer_steps)) if algo.anneal_lr else None

        def optimizer_for(lr: float) -> Callable:  # over the trained weights: all, or the LoRA adapters
            return lambda m: build_optimizer([p for p in m.parameters() if p.requires_grad], algo.optimizer, lr=lr,
                                             eps=algo.adam_eps, weight_decay=algo.weight_decay)

        actor = loading.load_causal_lm(policy_path, dtype, attention)
        if model_cfg.gradient_checkpointing:
            enable_gradient_checkpointing(actor)
        actor = with_lora(actor, model_cfg.lora, model_cfg.gradient_checkpointing)
        self.actor = TrainableModel(shard(actor), optimizer_for(algo.lr), schedule, algo.max_grad_norm)
        self.lora = model_cfg.lora.rank > 0
        # No KL at all (coefficient 0, not adaptive): no reference to load or run; its logprobs are pi_old's.
        self.uses_reference = algo.kl.adaptive or algo.kl.init_coef != 0
        # With LoRA the reference is the actor with its adapters off: the same frozen base, held once.
        self.reference = None
        if self.uses_reference and not self.lora:
            self.reference = shard(loading.load_causal_lm(policy_path, dtype, attention)).requires_grad_(False)
        self.critic = None
        if algo.advantage_estimator == "gae":
            critic = loading.ValueModel.from_pretrained(policy_path, dtype, attention)
            if model_cfg.gradient_checkpointing:
                enable_gradient_checkpointing(critic.backbone)
            critic = shard(critic)
            self.critic = TrainableModel(critic, optimizer_for(algo.critic_lr or algo.lr), schedule, algo.max_grad_norm)
        self.reward_model = None
        if reward_path is not None:
            rm = loading.load_reward_model(reward_path, dtype, tokenizer.pad_token_id, attention)
            self.reward_model = shard(rm).requires_grad_(False)
        self.kl_ctl = (alg.AdaptiveKLController(algo.kl.init_coef, algo.kl.target, algo.kl.horizon)
                       if algo.kl.adaptive else alg.FixedKLController(algo.kl.init_coef))
        self.truncate_id = None
        if cfg.reward.truncate_token is not None and self.reward_model is not None:
            self.truncate_id = loading.single_token_id(tokenizer, cfg.reward.truncate_token, "reward.truncate_token")

    # ------------------------------------------------------------------ scoring (forward only)

    def score(self, trajectories: list[Trajectory], old_from_engine: bool = False) -> Experience:
        """The step's batch (`Experience`, `[N, T]` rows) with old and reference logprobs and values added,
        and the reward-model scores (query + truncated response).

        `old_from_engine`: pi_old is the engine's sampling logprobs (the caller checked that engine and
        trainer agree), so only the reference and the critic run here, and nothing when neither exists."""
        exp = Experience.from_trajectories(trajectories, self.tokenizer.pad_token_id)
        batch, temperature = exp.batch, self.cfg.rollout.temperature
        wanted = {"old_logprobs": not old_from_engine, "ref_logprobs": self.uses_reference,
                  "values": self.critic is not None}

        def scoring_pass(micro_batch):
            outputs = []
            if wanted["old_logprobs"]:
                outputs.append(forward.token_logprobs(self.actor.model, micro_batch, temperature, actions_only=True))
            if wanted["ref_logprobs"]:
                outputs.append(self._reference_logprobs(micro_batch, temperature))
            if wanted["values"]:
                outputs.append(forward.token_values(self.critic.model, micro_batch))
            return tuple(outputs)

        names = [name for name, needed in wanted.items() if needed]
        if names:
            batch.update(zip(names, self.worker.gather(batch, scoring_pass)))
        batch.setdefault("old_logprobs", batch["behaviour_logprobs"].clone())
        batch.setdefault("ref_logprobs", batch["old_logprobs"].clone())  # no KL: KL 0
        batch.setdefault("values", torch.zeros_like(batch["old_logprobs"]))
        exp.scores, exp.rejected = self.reward_model_scores(trajectories)
        return exp

    def _reference_logprobs(self, batch, temperature: float) -> torch.Tensor:
        if self.reference is not None:
            return forward.token_logprobs(self.reference, batch, temperature, actions_only=True)
        with self.actor.model.disable_adapter():
            return forward.token_logprobs(self.actor.model, batch, temperature, actions_only=True)

    def reward_model_scores(self, trajectories: list[Trajectory]) -> tuple[torch.Tensor, torch.Tensor]:
        """Reward-model score of each trajectory (0 without a reward model) and whether it gets the
        rejection penalty instead. Collective when there is a reward model."""
        scores = torch.zeros(len(trajectories))
        rejected = torch.zeros(len(trajectories), dtype=torch.bool)
        if self.reward_model is None:
            return scores, rejected
        rm_ids, rejected = reward_model_inputs(trajectories, self.truncate_id, self.cfg.reward.truncate_after)

        rm_batch = layout.make_micro_batch([{"input_ids": ids, "action_mask": [0] * len(ids)} for ids in rm_ids],
                                           self.tokenizer.pad_token_id)
        return self.worker.gather(rm_batch, lambda b: (forward.reward_scores(self.reward_model, b),))[0], rejected

    # ------------------------------------------------------------------ PPO epochs

    def update(self, exp: Experience, targets: Targets, step: int) -> dict[str, float]:
        """`noptepochs` passes over freshly shuffled minibatches; then the adaptive KL step."""
        algo = self.cfg.algorithm
        n_traj = len(exp.trajectories)
        kl_coef = self.kl_ctl.value
        # Same permutation on every rank: ranks must agree on each minibatch's contents.
        generator = torch.Generator().manual_seed(self.cfg.trainer.seed * 1_000_003 + step)
        exp.batch.update(advantages=targets.advantages, returns=targets.returns)
        history: dict[str, list[float]] = {}
        for _epoch in range(algo.noptepochs):
            # Advantages were computed over whole groups before this point, so any split is safe; a batch
            # short of failed trajectories gives minibatches that differ in size by at most one.
            for minibatch in minibatch_indices(n_traj, algo.nminibatches, generator):
                for key, value in self._train_minibatch(exp, minibatch).items():
                    history.setdefault(key, []).append(value)
        # Adaptive KL (OpenAI): steer the per-episode KL of this batch towards the target.
        self.kl_ctl.update(targets.stats["kl/mean"], n_traj)
        # Every rank's rows, not rank 0's alone: a rank's loss is its share of the global loss x dp_size, so the
        # mean over ranks is the global loss; the other averages (clip fraction, entropy) become means over ranks.
        out = metrics_over_ranks({k: reduce_metric(k, v) for k, v in history.items()})
        out.update(targets.stats)
        out["kl/coef"] = kl_coef
        out["policy/lr"] = self.actor.current_lr()
        out["policy/optimizer_steps"] = len(history["policy/loss"])
        return out

    def _train_minibatch(self, exp: Experience, traj_ids: list[int]) -> dict[str, float]:
        algo = self.cfg.algorithm
        rows = exp.select(traj_ids)  # every rank holds the whole minibatch; the worker takes its share
        # The loss is divided by the minibatch's *global* count (the worker's scaling rule).
        norm_length = self.cfg.rollout.response_length * self.cfg.rollout.max_turns  # Dr. GRPO's constant
        count = alg.global_denominator(rows["action_mask"], algo.loss_agg, norm_length).item()
        micro = self.worker.micro_batches(rows)
        metrics, ran = self.worker.forward_backward(self.actor, rows, self._policy_loss, count, micro_batches=micro)
        out = {k: reduce_metric(k, v) for k, v in metrics.items() if k != "loss"}
        out["perf/padding_fraction"] = sum(layout.padding_fraction(b) for b in ran) / max(len(ran), 1)
        out["perf/train_grid_tokens"] = sum(layout.grid_tokens(b) for b in ran)  # positions a rank ran per minibatch
        out["policy/loss"] = sum(metrics["loss"])
        out["policy/grad_norm"] = self.actor.step()
        if self.critic is not None:
            metrics, _ = self.worker.forward_backward(self.critic, rows, self._value_loss, count, micro_batches=micro)
            out.update({k: sum(v) / len(v) for k, v in metrics.items() if k != "loss"})
            out["value/grad_norm"] = self.critic.step()
        return out

    def _policy_loss(self, model, batch: dict[str, torch.Tensor]):
        """Clipped surrogate (+ entropy bonus, + KL to the reference when it goes in the loss), each token
        weighted for the engine-trainer mismatch (algorithm.rollout_correction), sync and async alike."""
        algo = self.cfg.algorithm
        logprobs, entropy = forward.token_logprobs_and_entropy(model, batch, self.cfg.rollout.temperature,
                                                              entropy_grad=bool(algo.entropy_coef), actions_only=True)
        mask = batch["action_mask"]
        rc = algo.rollout_correction  # the engine sampled (pi_behaviour); the ratio is against the trainer's pi_old
        weights, correction = alg.rollout_correction_weights(batch["old_logprobs"], batch["behaviour_logprobs"], mask,
                                                             rc.mode, rc.is_cap, (rc.mask_low, rc.mask_high))
        low = algo.cliprange if algo.cliprange_low is None else algo.cliprange_low
        per_token, stats = alg.policy_loss(logprobs, batch["old_logprobs"], batch["advantages"], mask,
                                           low, behaviour_weights=weights, cliprange_high=algo.cliprange_high,
                                           sequence_ratio=algo.importance_ratio == "sequence")
        loss = alg.loss_sum(per_token, mask, algo.loss_agg)
        if algo.entropy_coef:
            loss = loss - algo.entropy_coef * alg.loss_sum(entropy, mask, algo.loss_agg)
        metrics = {"policy/clipfrac": stats["clipfrac"], "policy/approx_kl": stats["approx_kl"],
                   "policy/entropy": alg.masked_mean(entropy.detach(), mask),
                   **{f"rollout_correction/{k}": v for k, v in correction.items()}}
        if algo.kl.placement == "loss":  # GRPO: the KL to the reference in the loss, with gradient (use k3)
            kl = alg.kl_penalty(logprobs, batch["ref_logprobs"], algo.kl.estimator)
            loss = loss + self.kl_ctl.value * alg.loss_sum(kl, mask, algo.loss_agg)
            metrics["policy/kl_loss"] = alg.masked_mean(kl.detach(), mask)
        return loss, metrics

    def _value_loss(self, model, batch: dict[str, torch.Tensor]):
        """Clipped value loss, weighted by vf_coef."""
        algo = self.cfg.algorithm
        mask = batch["action_mask"]
        per_token, stats = alg.value_loss(forward.token_values(model, batch), batch["values"], batch["returns"], mask,
                                          algo.cliprange_value)
        loss = algo.vf_coef * alg.loss_sum(per_token, mask, algo.loss_agg)
        return loss, {"value/vf_clipfrac": stats["vf_clipfrac"],
                      "value/loss": alg.masked_mean(per_token.detach(), mask)}

    def models(self) -> dict:
        """The trained models by name, as checkpoints hold them."""
        return {"actor": self.actor} if self.critic is None else {"actor": self.actor, "critic": self.critic}

    # ------------------------------------------------------------------ weights for the engines

    def actor_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The actor's full weights, one tensor at a time (collective: every rank consumes it); with LoRA
        the adapters merged in, so the engines serve plain weights under the base model's names."""
        weights = iter_full_tensors(self.actor.model)
        return merged_weights(self.actor.model, weights) if self.lora else weights

    def probe_logprobs(self, probe_ids: list[int]) -> list[float]:
        """The actor's logprob of each probe token after the first, from raw logits (as SGLang reports them)."""
        probe = layout.make_micro_batch([{"input_ids": probe_ids, "action_mask": [1] * len(probe_ids)}],
                                        self.tokenizer.pad_token_id)
        with torch.no_grad():
            logprobs = forward.token_logprobs(self.actor.model, self.worker.micro_batch(probe, [0]), temperature=1.0)
        return logprobs[0, 1:].float().cpu().tolist()


def reduce_metric(key: str, values: list[float]) -> float:
    """Micro-batch (or minibatch) values of one metric as one: extremes stay extremes, the rest are averaged."""
    if key.endswith("_max"):
        return max(values)
    if key.endswith("_min"):
        return min(values)
    return sum(values) / len(values)


def enable_gradient_checkpointing(model) -> None:
    """Recompute each block's activations in backward instead of storing them (memory for compute).
    Non-reentrant checkpointing works under FSDP2; the KV cache is useless when training."""
    if hasattr(model, "activation_checkpointing_enable"):  # the name since transformers 5.x
        model.activation_checkpointing_enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False


def score_metrics(exp: Experience, old_from_engine: bool = False) -> dict[str, float]:
    """Reward and behaviour-policy statistics of a scored batch (the gap between recomputed old
    logprobs and the engine's only when they were recomputed: it is 0 by construction otherwise)."""
    n_traj = len(exp.trajectories)
    metrics = {"reward/score_mean": exp.scores.mean().item(),
               "reward/score_std": exp.scores.std().item() if n_traj > 1 else 0.0,
               "reward/rejected_frac": exp.rejected.float().mean().item(),
               "reward/env_mean": sum(t.env_reward for t in exp.trajectories) / max(n_traj, 1)}
    if not old_from_engine:
        batch = exp.batch
        acting = batch["action_mask"].bool()
        gap = (batch["old_logprobs"] - batch["behaviour_logprobs"]).abs()[acting]
        metrics["rollout/behaviour_logprob_gap"] = gap.mean().item() if gap.numel() else 0.0
    return metrics
