"""The models of one PPO rank, FSDP2-sharded: the actor (and critic) being trained, the frozen
reference, reward model and distillation teacher, and what the engines need of the actor (its weights, the probe)."""

from __future__ import annotations

import functools
from typing import Callable, Iterator

import torch

from rl_core.optim import build_optimizer, linear_anneal_schedule
from rl_core.ppo.config import AlgorithmConfig, DistillConfig, ModelConfig
from rl_core.ppo.distill import RemoteTeacher
from workers import forward, layout, loading
from workers.fsdp import iter_full_tensors, shard_model
from workers.trainable import TrainableModel
from workers.lora import merged_weights, with_lora
from workers.worker import BatchWorker


class PPOModels:
    """Actor (+ critic) being trained, frozen reference, reward model and teacher, all FSDP2-sharded."""

    def __init__(self, model_cfg: ModelConfig, algo: AlgorithmConfig, reward_path: str | None, pad_token_id: int,
                 total_steps: int, distill: DistillConfig | None = None):
        self.pad_token_id = pad_token_id
        policy_path = model_cfg.path
        dtype = getattr(torch, model_cfg.dtype)
        attention = model_cfg.attn_implementation
        shard = functools.partial(shard_model, mixed_precision=model_cfg.mixed_precision,
                                  cpu_offload=model_cfg.cpu_offload)
        # The schedule counts optimizer steps: epochs x minibatches of every PPO step (OpenAI anneals to zero).
        optimizer_steps = total_steps * algo.noptepochs * algo.nminibatches
        schedule = (lambda opt: linear_anneal_schedule(opt, optimizer_steps)) if algo.anneal_lr else None

        def optimizer_for(lr: float) -> Callable:  # over the trained weights: all, or the LoRA adapters
            return lambda m: build_optimizer([p for p in m.parameters() if p.requires_grad], algo.optimizer, lr=lr,
                                             eps=algo.adam_eps, weight_decay=algo.weight_decay)

        actor = loading.prepare_for_run(loading.load_causal_lm(policy_path, dtype, attention), model_cfg, trained=True)
        actor = with_lora(actor, model_cfg.lora, model_cfg.gradient_checkpointing)
        self.actor = TrainableModel(shard(actor), optimizer_for(algo.lr), schedule, algo.max_grad_norm)
        self.lora = model_cfg.lora.rank > 0
        # No KL at all (coefficient 0, not adaptive): no reference to load or run; its logprobs are pi_old's.
        self.uses_reference = algo.kl.adaptive or algo.kl.init_coef != 0
        # With LoRA the reference is the actor with its adapters off: the same frozen base, held once.
        self.reference = None
        if self.uses_reference and not self.lora:
            reference = loading.prepare_for_run(loading.load_causal_lm(policy_path, dtype, attention), model_cfg, False)
            self.reference = shard(reference).requires_grad_(False)
        self.critic = None
        if algo.advantage_estimator == "gae":
            critic = loading.ValueModel.from_pretrained(policy_path, dtype, attention)
            critic = shard(loading.prepare_for_run(critic, model_cfg, trained=True))
            self.critic = TrainableModel(critic, optimizer_for(algo.critic_lr or algo.lr), schedule, algo.max_grad_norm)
        self.reward_model = None
        if reward_path is not None:
            rm = loading.load_reward_model(reward_path, dtype, pad_token_id, attention)
            self.reward_model = shard(loading.prepare_for_run(rm, model_cfg, trained=False)).requires_grad_(False)
        # On-policy distillation: a frozen teacher beside the reference (counted by the memory plan, offloaded
        # with model.cpu_offload), or the user's server behind distill.teacher_url (rank 0 asks it).
        self.teacher, self.remote_teacher = None, None
        if distill is not None and distill.teacher_path is not None:
            teacher = loading.load_causal_lm(distill.teacher_path, dtype, attention)
            self.teacher = shard(loading.prepare_for_run(teacher, model_cfg, trained=False)).requires_grad_(False)
        if distill is not None and distill.teacher_url is not None:
            self.remote_teacher = RemoteTeacher(distill.teacher_url, distill.teacher_timeout_s)

    def reference_logprobs(self, batch: dict[str, torch.Tensor], temperature: float) -> torch.Tensor:
        """The frozen reference's logprobs of the actions (with LoRA: the actor with its adapters off)."""
        if self.reference is not None:
            return forward.token_logprobs(self.reference, batch, temperature, actions_only=True)
        with self.actor.model.disable_adapter():
            return forward.token_logprobs(self.actor.model, batch, temperature, actions_only=True)

    def teacher_logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The local teacher's logprobs of the actions, of its own distribution (temperature 1, as a server's)."""
        return forward.token_logprobs(self.teacher, batch, 1.0, actions_only=True)

    def trained(self) -> dict:
        """The trained models by name, as checkpoints hold them."""
        return {"actor": self.actor} if self.critic is None else {"actor": self.actor, "critic": self.critic}

    # ------------------------------------------------------------------ weights for the engines

    def actor_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The actor's full weights, one tensor at a time (collective: every rank consumes it); with LoRA
        the adapters merged in, so the engines serve plain weights under the base model's names."""
        weights = iter_full_tensors(self.actor.model)
        return merged_weights(self.actor.model, weights) if self.lora else weights

    def probe_logprobs(self, probe_ids: list[int], worker: BatchWorker) -> list[float]:
        """The actor's logprob of each probe token after the first, from raw logits (as SGLang reports them),
        laid out as the trainer's micro-batches are."""
        probe = layout.make_micro_batch([{"input_ids": probe_ids, "action_mask": [1] * len(probe_ids)}],
                                        self.pad_token_id)
        with torch.no_grad():
            logprobs = forward.token_logprobs(self.actor.model, worker.micro_batch(probe, [0]), temperature=1.0)
        return logprobs[0, 1:].float().cpu().tolist()

