"""The PPO job: `torchrun --nproc_per_node N -m rl_core.train --config ppo_sentiment.yaml [key=value ...]`.

Every rank trains with FSDP2 and owns an inference engine; rank 0 also runs the router and the
environments. `train` below is the whole loop; one step reads top to bottom in `train`'s body.
`trainer.mode=async` overlaps rollout with training.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed as dist
from transformers import AutoConfig

from envs.base import load_env_class
from rl_core.cli import parse_job_config, run_main
from rl_core.config import save_config, to_dict
from rl_core.distributed import broadcast_object, on_every_rank, on_rank0, rank_seed, seed_everything
from rl_core.errors import JobError
from rl_core.logger import MetricsLogger, StepTimer, print_step
from rl_core.ppo import algorithms as alg
from rl_core.ppo.checkpoint import Checkpointer
from rl_core.ppo.config import PPOConfig, check_context_length, validate
from rl_core.ppo.experience import compute_advantages, final_response
from rl_core.ppo.trainer import PPOTrainer, score_metrics
from rl_core.rollout.prompts import prompt_samples
from rl_core.runtime import JobRuntime
from workers import models
from workers.engines.client import EngineError
from workers.engines.weights import probe_token_ids


def main(argv: list[str] | None = None) -> None:
    run_main(_main, argv, stop_hint="trainer.resume=auto continues from the last checkpoint")


def _main(argv: list[str] | None) -> None:
    cfg = parse_job_config(argv, __doc__, "ppo_sentiment.yaml", PPOConfig, validate)
    with JobRuntime(cfg) as rt:
        train(cfg, rt)


def train(cfg: PPOConfig, rt: JobRuntime) -> None:
    load_env_class(cfg.env.cls)  # a wrong import path fails here, before any engine starts
    policy_path, reward_path, prompts_path = resolve_paths(cfg, rt.rank)
    tokenizer = models.load_tokenizer(cfg.model.tokenizer_path or policy_path)
    max_positions = models.context_length(AutoConfig.from_pretrained(policy_path))
    check_context_length(cfg, max_positions)
    seed_everything(rank_seed(cfg.trainer.seed, rt.rank))
    run_dir = Path(cfg.trainer.run_dir)
    batch_size = cfg.algorithm.batch_size
    total_steps = cfg.trainer.total_episodes // batch_size
    # Rank 0 reads the prompts before any engine or model loads: a data error costs seconds, not minutes.
    prompts = on_rank0(lambda: prompt_samples(cfg.data, prompts_path, tokenizer, batch_size, cfg.algorithm.group_size,
                                              cfg.trainer.seed))
    rt.start_engines(policy_path)
    trainer = PPOTrainer(cfg, tokenizer, policy_path, reward_path, total_steps, rt.device, rt.rank, rt.world_size)
    checkpointer = Checkpointer(run_dir / "checkpoints", rt.rank, keep_last=cfg.trainer.keep_last)
    start_step = checkpointer.maybe_resume(cfg.trainer.resume, trainer, prompts)
    logger = None
    if rt.rank == 0:
        # Rows after the checkpoint's step (written by the interrupted run) are dropped: each step once.
        logger = MetricsLogger(run_dir, to_dict(cfg), cfg.trainer.wandb, cfg.trainer.wandb_project,
                               resume_step=start_step)
        save_config(cfg, run_dir / "config.yaml")

    probe = probe_token_ids(tokenizer)
    version = start_step
    rt.sync_weights(trainer.actor_weights(), version, probe, trainer.probe_logprobs(probe))
    service = rt.start_rollout_service(tokenizer, max_positions) if rt.rank == 0 else None
    if service is not None and cfg.trainer.mode == "async":
        service.start_producer(prompts, lambda: rt.engine_version, cfg.async_.queue_batches)

    for step in range(start_step, total_steps):
        timer = StepTimer()
        with timer("rollout"):  # 1. rollout through the router (rank 0), broadcast to every rank
            trajectories, metrics = collect_batch(cfg, rt, service, prompts, version)
        with timer("inference"):
            rt.release_engine_memory()  # 2. sync mode: engines free their KV cache and weights
            exp = trainer.score(trajectories)  # 3. old/ref logprobs, values, reward-model scores
            metrics.update(score_metrics(exp))
        with timer("train"):
            # 4. rejection penalty (OpenAI): no period after token 16 -> fixed score
            scores = alg.penalize_rejected(exp.scores, exp.rejected, cfg.reward.penalty)
            # 5. KL-penalised rewards, reward whitening, GAE (or group baselines), advantage whitening
            algo = cfg.algorithm
            targets = compute_advantages(exp, scores, trainer.kl_ctl.value, gamma=algo.gamma, lam=algo.lam,
                                         kl_estimator=algo.kl.estimator, whiten_rewards=algo.whiten_rewards,
                                         estimator=algo.advantage_estimator, group_size=algo.group_size)
            metrics.update(trainer.update(exp, targets, step))  # 6. PPO epochs x minibatches, adaptive KL
        with timer("sync"):  # 7. new weights into every engine, checked by version and probe logprobs
            version = step + 1
            metrics.update(rt.sync_weights(trainer.actor_weights(), version, probe, trainer.probe_logprobs(probe)))
        if rt.rank == 0:
            metrics.update(timer.metrics())
            tokens = sum(t.num_tokens for t in trajectories)
            metrics.update({"perf/tokens_per_s": tokens / metrics["perf/step_s"],
                            "perf/episodes_per_s": len(trajectories) / metrics["perf/step_s"],
                            "episodes": (step + 1) * batch_size})
            logger.log(step + 1, metrics)
            print_step(step + 1, total_steps, metrics)
            if cfg.trainer.log_samples_every and (step % cfg.trainer.log_samples_every == 0 or step + 1 == total_steps):
                logger.log_samples(step + 1, sample_rows(tokenizer, exp, scores, n=4))
        # Saved after the step is logged: a run killed in between resumes from the previous checkpoint
        # and logs this step again (the resumed logger drops the extra row), so no step goes missing.
        if cfg.trainer.save_every and (step + 1) % cfg.trainer.save_every == 0:
            # Async: the position after the last batch trained on, not the producer's, which runs ahead.
            data_state = None if rt.rank != 0 else (
                prompts.state_dict() if cfg.trainer.mode == "sync" else service.resume_state)
            checkpointer.save(step + 1, trainer, data_state)

    if cfg.trainer.export_hf:
        export_policy(trainer, tokenizer, policy_path, run_dir / "final", rt.rank)
    if logger is not None:
        logger.close()


def collect_batch(cfg: PPOConfig, rt: JobRuntime, service, prompts, version: int) -> tuple[list, dict]:
    """Rank 0 collects one batch (sync: generate now; async: take fresh-enough queued ones); all ranks get it."""
    trajectories, metrics = None, {}
    if rt.rank == 0:
        try:
            if cfg.trainer.mode == "sync":
                result, dropped = service.collect(next(prompts), version), 0
            else:
                result, dropped = service.next_batch(cfg.algorithm.batch_size, version, cfg.async_.max_staleness)
        except EngineError as err:
            dead = rt.dead_engines()
            if not dead:
                raise
            raise JobError(f"rollout failed: {'; '.join(dead)}; see that log (trainer.resume=auto continues from "
                           f"the last checkpoint) [{err}]") from err
        trajectories, metrics = result.trajectories, dict(result.metrics)
        metrics["async/dropped_stale"] = dropped
        metrics["async/staleness_max"] = max((version - t.min_version for t in trajectories), default=0)
    trajectories, metrics = broadcast_object((trajectories, metrics))
    if not trajectories:
        raise JobError("the rollout produced no usable trajectory (every env failed); see rank 0's log")
    return trajectories, metrics


def resolve_paths(cfg: PPOConfig, rank: int) -> tuple[str, str | None, str]:
    """Policy, reward-model and prompt paths; the offline tiny assets are built if a path says "tiny".

    Paths the user gave are checked first, before minutes go into building tiny assets or loading
    models: a local path must be a model directory, anything else a hub name (tried once).
    """
    def check_user_paths() -> None:
        for key, value in (("model.path", cfg.model.path), ("reward.model_path", cfg.reward.model_path),
                           ("model.tokenizer_path", cfg.model.tokenizer_path)):
            if value not in (None, "tiny"):
                models.check_model_path(value, key, need_config=key != "model.tokenizer_path")

    on_every_rank(check_user_paths)
    paths = None
    if "tiny" in (cfg.model.path, cfg.reward.model_path, cfg.data.train_path):
        from rl_core.tiny.assets import ensure_tiny_assets
        from rl_core.tiny.reward_model import ensure_tiny_reward_model

        if rank == 0:  # rank 0 builds (and logs) what is missing while the others wait; the build is locked anyway
            paths = ensure_tiny_assets(log=print, progress=cfg.trainer.progress)
            if cfg.reward.model_path == "tiny":
                ensure_tiny_reward_model(paths, log=print, progress=cfg.trainer.progress)
        dist.barrier()
        paths = ensure_tiny_assets(log=lambda *_: None)
    policy = str(paths.model_dir) if cfg.model.path == "tiny" else cfg.model.path
    reward = cfg.reward.model_path or None
    if reward == "tiny":
        reward = str(ensure_tiny_reward_model(paths, log=lambda *_: None))
    prompts = str(paths.train_prompts) if cfg.data.train_path == "tiny" else cfg.data.train_path
    return policy, reward, prompts


def sample_rows(tokenizer, exp, scores, n: int) -> list[dict]:
    """A few (query, response, score) rows for the samples table."""
    rows = []
    for t, traj in enumerate(exp.trajectories[:n]):
        context, response = final_response(traj)
        rows.append({"query": tokenizer.decode(context, skip_special_tokens=True),
                     "response": tokenizer.decode(response, skip_special_tokens=True),
                     "score": float(scores[t])})
    return rows


def export_policy(trainer: PPOTrainer, tokenizer, policy_path: str, out_dir: Path, rank: int) -> None:
    """The final policy in Hugging Face format (save_pretrained + tokenizer), loadable by SGLang."""
    from workers.fsdp import full_state_dict

    state = full_state_dict(trainer.actor.model)  # collective: every rank gathers
    if rank != 0:
        return
    model = models.load_causal_lm(policy_path)
    model.load_state_dict(state)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    print(f"final policy saved to {out_dir}")


if __name__ == "__main__":
    main(sys.argv[1:])
