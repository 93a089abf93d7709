"""The PPO job's memory plan: its models and work as `workers.memory_plan` reads them.

Run on rank 0 before the engines start (the plan sizes their KV pool); every rank takes rank 0's plan,
so all release or none do.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from rl_core.ppo.config import PPOConfig, engine_dtype, max_sequence_length
from workers.memory_plan import (DTYPE_BYTES, GIB, OPTIMIZER_STATES, Device, MemoryInputs, MemoryPlan,
                                 count_parameters, decide_release, model_shape, plan_memory)


def memory_inputs(cfg: PPOConfig, policy_config, reward_params: int, dp_size: int, device: Device,
                  context_length: int | None) -> MemoryInputs:
    """The plan's numbers for this job: which models train and which are frozen, in which dtypes, and how
    many sequences the rollout keeps in flight on the engines."""
    model, algo, ro = cfg.model, cfg.algorithm, cfg.rollout
    policy = model_shape(policy_config)
    lora = model.lora.rank > 0
    critic = algo.advantage_estimator == "gae"
    uses_reference = algo.kl.adaptive or algo.kl.init_coef != 0
    # A LoRA actor's base is frozen (its reference is the same weights with the adapters off); the
    # adapters' own gradients and states are a fraction of a percent of the model, inside the reserve.
    trained = (0 if lora else 1) + int(critic)
    frozen = (policy.params if lora or uses_reference else 0) + reward_params
    master = DTYPE_BYTES[model.dtype]
    compute = 2 if model.mixed_precision else master
    # Every prompt of a batch (more under DAPO's filtering), or an evaluation's, may be in flight at once,
    # as many as the rollout's concurrency and the env pool allow.
    launched = algo.batch_size * (algo.filter_max_groups_factor if algo.filter_zero_variance_groups else 1)
    if cfg.data.eval_path is not None:
        launched = float("inf")  # the held-out set's size is not known here: its bound is the pool's
    in_flight = int(min(launched, ro.concurrency, cfg.env.num_envs))
    # Async: the producer's batches and an evaluation (or requests paused across a push) can overlap.
    batches = cfg.async_.batches_in_flight + 1 if cfg.trainer.mode == "async" else 1
    static = None
    if ro.engine == "sglang" and device.kind == "cuda":  # SGLang never holds more than this share of the GPU
        static = int(ro.mem_fraction_static * device.total_bytes)
    user_tokens = ro.kv_tokens if ro.kv_tokens is not None else ro.sglang_args.get("max_total_tokens")
    # A trained micro-batch holds at most one rank's share of a minibatch: with short sequences that, not
    # max_tokens_per_device, bounds the activations (SmolLM2-135M on 32 x 128 tokens: 17 GiB planned from
    # the 8192-token cap, where the trainer's whole peak was under 3 GiB). Shared prompts run once a group.
    rank_sequences = math.ceil(algo.batch_size / algo.nminibatches / dp_size)
    longest, prompt = max_sequence_length(cfg), cfg.data.max_prompt_length
    minibatch_share = rank_sequences * longest
    if algo.packing and algo.share_prompts and algo.group_size > 1:
        minibatch_share = rank_sequences * (longest - prompt) + math.ceil(rank_sequences / algo.group_size) * prompt
    return MemoryInputs(policy=policy, engine_dtype_bytes=DTYPE_BYTES[engine_dtype(cfg)],
                        master_dtype_bytes=master, compute_dtype_bytes=compute,
                        optimizer_states=OPTIMIZER_STATES[algo.optimizer], trained_models=trained,
                        frozen_params=frozen, dp_size=dp_size, tp_size=ro.tp_size, cpu_offload=model.cpu_offload,
                        max_tokens_per_device=min(algo.max_tokens_per_device, minibatch_share),
                        gradient_checkpointing=model.gradient_checkpointing, logits_chunk=model.logits_chunk,
                        sequences_in_flight=in_flight, batches_in_flight=batches,
                        sequence_tokens=max_sequence_length(cfg), engines=dp_size,
                        min_kv_tokens=context_length or max_sequence_length(cfg),
                        kv_tokens=None if user_tokens is None else int(user_tokens), engine_static_bytes=static)


def plan_job_memory(cfg: PPOConfig, detected: Device, world_size: int, context_length: int | None) -> MemoryPlan | None:
    """Read the models' configs (no weights: parameters are counted on the meta device) and plan; None (and
    a line saying why) for a model whose config the plan cannot read, which must not stop a job that runs."""
    try:
        return _plan(cfg, detected, world_size, context_length)
    except Exception as err:  # noqa: BLE001 - e.g. a remote-code model that builds only with its own code
        print(f"memory plan unavailable ({type(err).__name__}: {err}); engines release memory each sync step "
              "unless rollout.release_memory=never, and SGLang sizes its own KV pool", flush=True)
        return None


def _plan(cfg: PPOConfig, detected: Device, world_size: int, context_length: int | None) -> MemoryPlan:
    from transformers import AutoConfig

    device = detected
    if cfg.rollout.device_memory_gb is not None:
        device = Device.of(detected.kind, int(cfg.rollout.device_memory_gb * GIB))
    reward_params = 0  # the frozen models besides the policy's own: the reward model and a local teacher
    if cfg.reward.model_path:
        reward_params = count_parameters(AutoConfig.from_pretrained(cfg.reward.model_path), sequence_classification=True)
    if cfg.distill.teacher_path:
        reward_params += count_parameters(AutoConfig.from_pretrained(cfg.distill.teacher_path))
    inputs = memory_inputs(cfg, AutoConfig.from_pretrained(cfg.model.path), reward_params, world_size, device,
                           context_length)
    return plan_memory(inputs, device)


def decide(mode: str, plan: MemoryPlan | None) -> bool:
    """Whether engines release memory each sync step; without a plan, auto keeps the safe old behaviour."""
    if plan is None:
        return mode != "never"
    return decide_release(mode, plan)


def report_plan(plan: MemoryPlan, release: bool, run_dir: Path) -> None:
    """Rank 0: the plan's block on the console and `memory_plan.json` in the run directory."""
    print("\n".join(plan.lines(release)), flush=True)
    (run_dir / "memory_plan.json").write_text(json.dumps({**plan.to_dict(), "release": release}, indent=1))
