"""The PPO job: `torchrun --nproc_per_node N -m rl_core.train --config ppo_sentiment.yaml [key=value ...]`.

Every rank trains with FSDP2 and owns an inference engine; rank 0 also runs the router and the
environments. `train` below is the whole loop; one step reads top to bottom in `train`'s body.
`trainer.mode=async` overlaps rollout with training.
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path
from typing import Callable

from transformers import AutoConfig

from envs.base import load_env_class
from rl_core.cli import parse_job_config, run_main
from rl_core.config import save_config, to_dict
from rl_core.distributed import (broadcast_object, on_every_rank, on_rank0, prepare_before_process_group,
                                 rank_seed, seed_everything)
from rl_core.errors import JobError
from rl_core.logger import MetricsLogger, StepTimer, print_step
from rl_core.ppo.checkpoint import Checkpointer
from rl_core.ppo.config import PPOConfig, check_context_length, validate
from rl_core.ppo.evaluation import evaluate, print_eval
from rl_core.ppo.experience import apply_group_rule, compute_advantages, has_reward_variance, task_scores
from rl_core.ppo.trainer import PPOTrainer, score_metrics
from rl_core.rewards import load_reward_fn
from rl_core.rollout.prompts import eval_samples, prompt_samples
from rl_core.ppo.runtime import JobRuntime
from workers import models
from workers.engines.client import EngineError
from workers.engines.weights import probe_token_ids


def main(argv: list[str] | None = None, prepare: Callable[[PPOConfig, Callable[[str], None]], PPOConfig] | None = None,
         ) -> None:
    """`prepare(cfg, log)` (the entry point's: offline assets named in the recipe) runs on every rank before
    the process group exists, so however long it takes no rank waits for it inside a collective."""
    run_main(lambda args: _main(args, prepare), argv, stop_hint="trainer.resume=auto continues from the last checkpoint")


def _main(argv: list[str] | None, prepare) -> None:
    cfg = parse_job_config(argv, __doc__, "ppo_sentiment.yaml", PPOConfig, validate)
    if prepare is not None:
        cfg = prepare_before_process_group(lambda log: prepare(cfg, log), "prepare the offline assets")
    with JobRuntime(cfg) as rt:
        train(cfg, rt)


def train(cfg: PPOConfig, rt: JobRuntime) -> None:
    load_env_class(cfg.env.cls)  # a wrong import path fails here, before any engine starts
    for spec in cfg.reward.fns.values():
        load_reward_fn(spec["fn"])
    on_every_rank(lambda: check_model_paths(cfg))  # one line before minutes go into loading models
    policy_path, reward_path = cfg.model.path, cfg.reward.model_path or None
    prompts_path, eval_path = cfg.data.train_path, cfg.data.eval_path
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
    held_out = None
    if eval_path is not None:
        held_out = on_rank0(lambda: eval_samples(cfg.data, eval_path, tokenizer, cfg.eval.n, cfg.eval.max_prompts))
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
    if eval_path is not None and start_step == 0:  # the baseline every later evaluation compares with
        eval_metrics_, rows = evaluate(cfg, rt.rank, service, trainer, tokenizer, held_out, version)
        if rt.rank == 0:
            logger.log(0, eval_metrics_)
            logger.log_samples(0, rows, table="eval_samples")
            print_eval(0, eval_metrics_)
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
            # 4. scores: reward model (OpenAI rejection penalty: no period after token 16 -> fixed score)
            #    + reward functions, truncation penalty, overlong shaping
            scores, stats = task_scores(exp, cfg.reward, cfg.algorithm, cfg.rollout.response_length)
            metrics.update(stats)
            # 5. KL-penalised rewards, reward whitening, GAE (or group baselines by group id), advantage whitening
            targets = compute_advantages(exp, scores, trainer.kl_ctl.value, cfg.algorithm)
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
            metrics["data/prompts_skipped"] = prompts.skipped
        eval_rows_ = None
        if eval_path is not None and (step + 1 == total_steps or (cfg.trainer.eval_every
                                                                  and (step + 1) % cfg.trainer.eval_every == 0)):
            started = time.perf_counter()  # 8. held-out prompts with the new weights (not in perf/step_s)
            eval_metrics_, eval_rows_ = evaluate(cfg, rt.rank, service, trainer, tokenizer, held_out, version)
            metrics.update(eval_metrics_, **{"perf/eval_s": time.perf_counter() - started})
        if rt.rank == 0:
            logger.log(step + 1, metrics)
            print_step(step + 1, total_steps, metrics)
            if eval_rows_ is not None:
                logger.log_samples(step + 1, eval_rows_, table="eval_samples")
                print_eval(step + 1, metrics)
            if cfg.trainer.log_samples_every and (step % cfg.trainer.log_samples_every == 0 or step + 1 == total_steps):
                logger.log_samples(step + 1, sample_rows(tokenizer, exp, scores, n=4))
        # Saved after the step is logged: a run killed in between resumes from the previous checkpoint
        # and logs this step again (the resumed logger drops the extra row), so no step goes missing.
        if cfg.trainer.save_every and (step + 1) % cfg.trainer.save_every == 0:
            # Async: the position after the last batch trained on, not the producer's, which runs ahead.
            data_state = None if rt.rank != 0 else (
                prompts.state_dict() if cfg.trainer.mode == "sync" else service.resume_state)
            checkpointer.save(step + 1, trainer, data_state)

    rt.stop_node_watch()  # other nodes may finish first and stop their engines
    if cfg.trainer.export_hf:
        export_policy(trainer, tokenizer, policy_path, run_dir / "final", rt.rank)
    if logger is not None:
        logger.close()


def collect_batch(cfg: PPOConfig, rt: JobRuntime, service, prompts, version: int) -> tuple[list, dict]:
    """Rank 0 collects one batch (sync: generate now; async: take fresh-enough queued ones); all ranks get it."""
    trajectories, metrics = None, {}
    algo = cfg.algorithm
    if rt.rank == 0:
        try:
            if cfg.trainer.mode == "sync" and algo.filter_zero_variance_groups:
                # DAPO dynamic sampling: a group whose rewards are all equal has no signal; sample more prompts
                n_groups = algo.batch_size // algo.group_size
                varied = functools.partial(has_reward_variance, reward=cfg.reward, algo=algo,
                                           response_length=cfg.rollout.response_length)
                result = service.collect_groups(prompts.groups(), n_groups, varied,
                                                max(n_groups, int(algo.filter_max_groups_factor * n_groups)), version)
                dropped = 0
            elif cfg.trainer.mode == "sync":
                result, dropped = service.collect(next(prompts), version), 0
            else:
                result, dropped = service.next_batch(algo.batch_size, version, cfg.async_.max_staleness)
        except EngineError as err:
            dead = rt.dead_engines()
            if not dead:
                raise
            raise JobError(f"rollout failed: {'; '.join(dead)}; see that log (trainer.resume=auto continues from "
                           f"the last checkpoint) [{err}]") from err
        trajectories, metrics = result.trajectories, dict(result.metrics)
        if algo.advantage_estimator != "gae":
            trajectories, group_stats = apply_group_rule(trajectories, algo.group_size, algo.incomplete_groups)
            metrics.update(group_stats)
        metrics["async/dropped_stale"] = dropped
        metrics["async/staleness_max"] = max((version - t.min_version for t in trajectories), default=0)
    trajectories, metrics = broadcast_object((trajectories, metrics))
    if not trajectories:
        raise JobError("the rollout produced no usable trajectory (every env failed); see rank 0's log")
    return trajectories, metrics


def check_model_paths(cfg: PPOConfig) -> None:
    """A local model path must be a model directory; anything else is a hub name, tried once."""
    for key, value in (("model.path", cfg.model.path), ("reward.model_path", cfg.reward.model_path),
                       ("model.tokenizer_path", cfg.model.tokenizer_path)):
        if value is not None:
            models.check_model_path(value, key, need_config=key != "model.tokenizer_path")


def sample_rows(tokenizer, exp, scores, n: int) -> list[dict]:
    """A few (query, response, score) rows for the samples table."""
    rows = []
    for t, traj in enumerate(exp.trajectories[:n]):
        context, response = traj.final_response()
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
