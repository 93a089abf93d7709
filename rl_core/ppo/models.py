"""The models of one PPO rank, FSDP2-sharded: the actor (and critic) being trained, the frozen
reference, reward model and distillation teacher, and what the engines need of the actor (its weights, the probe)."""

from __future__ import annotations

from typing import Iterator

import torch

from rl_core.model_builder import Optimization, Placement, build_frozen, build_trained
from rl_core.optim import linear_anneal_schedule
from rl_core.ppo.config import AlgorithmConfig, DistillConfig, ModelConfig
from rl_core.ppo.distill import RemoteTeacher
from workers import forward, layout
from workers.engines.weights import Probe
from workers.fsdp import iter_full_tensors
from workers.lora import merged_weights
from workers.vision import step_images
from workers.worker import BatchWorker


class PPOModels:
    """Actor (+ critic) being trained, frozen reference, reward model and teacher, all FSDP2-sharded."""

    def __init__(self, model_cfg: ModelConfig, algo: AlgorithmConfig, reward_path: str | None, pad_token_id: int,
                 total_steps: int, distill: DistillConfig | None = None):
        self.pad_token_id = pad_token_id
        policy_path = model_cfg.path
        on_rank = Placement(sharded=True)
        # The schedule counts optimizer steps: epochs x minibatches of every PPO step (OpenAI anneals to zero).
        optimizer_steps = total_steps * algo.noptepochs * algo.nminibatches
        schedule = (lambda opt: linear_anneal_schedule(opt, optimizer_steps)) if algo.anneal_lr else None

        # The optimizer keys of algorithm.* (every job's set), over the trained weights: all, or the LoRA adapters.
        self.actor = build_trained(policy_path, "causal_lm", model_cfg, on_rank,
                                   Optimization.from_config(algo, schedule))
        self.lora = model_cfg.lora.rank > 0
        # No KL at all (coefficient 0, not adaptive): no reference to load or run; its logprobs are pi_old's.
        self.uses_reference = algo.kl.adaptive or algo.kl.init_coef != 0
        # With LoRA the reference is the actor with its adapters off: the same frozen base, held once.
        self.reference = None
        if self.uses_reference and not self.lora:
            self.reference = build_frozen(policy_path, "causal_lm", model_cfg, on_rank)
        self.critic = None
        if algo.advantage_estimator == "gae":
            self.critic = build_trained(policy_path, "value", model_cfg, on_rank,
                                        Optimization.from_config(algo, schedule, lr=algo.critic_lr))
        self.reward_model = None
        if reward_path is not None:
            self.reward_model = build_frozen(reward_path, "reward", model_cfg, on_rank, pad_token_id=pad_token_id)
        # On-policy distillation: a frozen teacher beside the reference (counted by the memory plan, offloaded
        # with model.cpu_offload), or the user's server behind distill.teacher_url (rank 0 asks it).
        self.teacher, self.remote_teacher = None, None
        if distill is not None and distill.teacher_path is not None:
            self.teacher = build_frozen(distill.teacher_path, "causal_lm", model_cfg, on_rank)
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

    def scoring_outputs(self, names: tuple[str, ...], temperature: float,
                        batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The step's forward-only outputs `names` on one micro-batch, in that order (`BatchWorker.gather`'s fn):
        old and reference logprobs, values, the local teacher's logprobs."""
        def output(name: str) -> torch.Tensor:
            if name == "old_logprobs":
                return forward.token_logprobs(self.actor.model, batch, temperature, actions_only=True)
            if name == "ref_logprobs":
                return self.reference_logprobs(batch, temperature)
            if name == "values":  # OpenAI detail: the value of the state before each token, from query + response
                return forward.token_values(self.critic.model, batch)
            return self.teacher_logprobs(batch)  # on-policy distillation (rl_core/ppo/distill.py)

        return tuple(output(name) for name in names)

    def reward_scores(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor]:
        """The reward model's score of each row of one micro-batch (`BatchWorker.gather`'s fn)."""
        return (forward.reward_scores(self.reward_model, batch),)

    def trained(self) -> dict:
        """The trained models by name, as checkpoints hold them."""
        return {"actor": self.actor} if self.critic is None else {"actor": self.actor, "critic": self.critic}

    # ------------------------------------------------------------------ weights for the engines

    def actor_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The actor's full weights, one tensor at a time (collective: every rank consumes it); with LoRA
        the adapters merged in, so the engines serve plain weights under the base model's names."""
        weights = iter_full_tensors(self.actor.model)
        return merged_weights(self.actor.model, weights) if self.lora else weights

    def probe_logprobs(self, probe: Probe, worker: BatchWorker) -> list[float]:
        """The actor's logprob of each probe token after the first, from raw logits (as SGLang reports them),
        laid out as the trainer's micro-batches are; a vision-language probe's picture runs through the tower."""
        batch = layout.rows_to_batch([{"input_ids": probe.ids, "action_mask": [1] * len(probe.ids)}], self.pad_token_id)
        if probe.images is not None:  # carried as a step batch carries a row's images
            batch.update(step_images([(probe.images["pixel_values"], probe.images["image_grid_thw"])]))
        with torch.no_grad():
            logprobs = forward.token_logprobs(self.actor.model, worker.micro_batch(batch, [0]), temperature=1.0)
        return logprobs[0, 1:].float().cpu().tolist()

