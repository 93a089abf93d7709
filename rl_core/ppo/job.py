"""The PPO job: `torchrun --nproc_per_node N -m rl_core.train --config ppo_sentiment.yaml [key=value ...]`.

Every rank trains with FSDP2 and owns an inference engine; rank 0 also runs the router and the
environments. `train` below is the whole job and `ppo_step` one step, top to bottom; what happens around
each step (profiling, evaluations, the log row, checkpoints) is every job's loop, `rl_core/step_loop.py`.
`trainer.mode=async` overlaps rollout with training.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from envs.factory import load_env_class
from rl_core.checkpoint import end_if_finished, export_final
from rl_core.cli import JobEntry, run_job
from rl_core.errors import JobError
from rl_core.stop_signal import StepProgress
from rl_core.distributed import (broadcast_object, max_over_ranks, on_every_rank, on_rank0, rank_seed,
                                 seed_everything)
from rl_core.ppo.collect import Collector, make_collector
from rl_core.ppo.config import PPOConfig, release_mode, rollout_settings
from rl_core.ppo.validation import check_models, validate
from rl_core.ppo.memory import decide, plan_job_memory, report_plan
from rl_core.ppo.evaluation import evaluate, print_eval
from rl_core.ppo import algorithms as alg
from rl_core.ppo.distill import RemoteTeacher, check_same_tokenizer
from rl_core.ppo.models import PPOModels
from rl_core.ppo.step import (Experience, StepSettings, compute_advantages, forward_passes, minibatch_order,
                              reward_model_scores, score_metrics, task_scores, train_minibatch, update_metrics)
from rl_core.rewards import load_reward_fn
from rl_core.ppo.runtime import PPORuntime
from rl_core.rollout.prompts import eval_samples, prompt_samples
from rl_core.rollout.service import RolloutService
from rl_core.training_run import ConsoleLine, TrainingRun
from workers import loading
from workers.engines.embedded.forked import EngineFork
from workers.engines.spec import is_vision_language
from workers.engines.weights import Probe, probe_token_ids
from workers.memory_plan import MemoryPlan, detect_device
from workers.trace import StepTimer, span
from workers.vision import load_processor, vision_probe
from workers.worker import BatchWorker


def main(argv: list[str] | None = None, prepare: Callable[[PPOConfig, Callable[[str], None]], PPOConfig] | None = None,
         ) -> None:
    """`prepare(cfg, log)` (the entry point's: offline assets named in the recipe) runs on every rank before
    the process group exists, so however long it takes no rank waits for it inside a collective."""
    # Forked first, before any set-up runs a multi-threaded op: see workers/engines/embedded/forked.py.
    engine_fork = EngineFork.fork()
    run_job(argv, JobEntry(__doc__, "ppo_sentiment.yaml", PPOConfig, validate, check_models,
                           runtime=functools.partial(PPORuntime, engine_fork=engine_fork),
                           children="engines and router"), train, prepare)


def train(cfg: PPOConfig, rt: PPORuntime, progress: StepProgress | None = None) -> None:
    """`progress`: where the loop is, for the line a stop signal ends with (`run_main`'s)."""
    progress = progress or StepProgress(rt.rank)
    tr = cfg.trainer
    if end_if_finished(tr, tr.total_episodes // cfg.algorithm.batch_size, f"trainer.total_episodes={tr.total_episodes}"
                       f" / algorithm.batch_size={cfg.algorithm.batch_size}", "raise trainer.total_episodes to train on",
                       rt.rank):  # before any engine starts
        return
    job = start_job(cfg, rt)  # checks, prompts, engines, models, resume, logger, first push, rollout service
    # Around each step (the evaluation before training, profiling, evaluations, the log, checkpoints) is every
    # job's run: rl_core/training_run.py.
    job.run.run_steps(lambda step: ppo_step(job, rt, step, progress), rt.device, progress,
                      evaluate=lambda step: run_evaluation(job, rt, step), eval_due=job.eval_due,
                      log=lambda step, metrics: log_step(job, step, metrics), first_phase="rollout")
    # Rank 0's last evaluation runs on every rank's engine: no rank may stop its engine before it ends.
    dist.barrier()
    rt.stop_node_watch()  # other nodes may finish first and stop their engines
    job.run.finish(lambda: export_final(cfg, job.models.actor.model, job.tokenizer, rt.rank))


def ppo_step(job: Job, rt: PPORuntime, step: int, progress: StepProgress) -> dict[str, float]:
    """One PPO step, top to bottom: rollout, scoring, update, weight push. Its metrics; the step's sample table
    waits in `job.sample_rows` for the log."""
    cfg, models, worker, settings = job.cfg, job.models, job.worker, job.settings
    timer = StepTimer()
    progress.at(step + 1, "rollout")
    with timer("rollout"):  # 1. rollout through the router (rank 0), broadcast to every rank
        trajectories, metrics = job.collector.batch(step)
    progress.at(step + 1, "scoring")
    with timer("inference"):
        if job.collector.engines_idle_while_training:  # 2. sync mode: engines free their KV cache and weights
            # (when the memory plan or rollout.release_memory says so)
            metrics["perf/release_s"] = rt.release_engine_memory()
            metrics["memory/released"] = float(rt.release_each_step)
        # 3. the step's batch as [N, T] tensors, once; old/ref logprobs, values, reward-model scores.
        #    pi_old is the engine's own logprobs when they are the trainer's (sync, probe gap within
        #    algorithm.old_logprobs_max_gap): no recompute
        old_from_engine = settings.old_logprobs_from_engine(job.probe_gap)
        exp = Experience.from_trajectories(trajectories, job.tokenizer.pad_token_id)
        with span("forward passes"), rt.threads_beside_decoding():  # async: the engine decodes the next batch
            exp = forward_passes(exp, models, worker, settings, old_from_engine)
        metrics.update(score_metrics(exp, old_from_engine))
        metrics["perf/old_logprobs_from_engine"] = float(old_from_engine)
    progress.at(step + 1, "update")
    with timer("train"):
        # 4. scores: reward model (OpenAI rejection penalty: no period after token 16 -> fixed score)
        #    + reward functions, truncation penalty, overlong shaping
        scores, stats = task_scores(exp, settings.scoring)
        metrics.update(stats)
        # 5. KL-penalised rewards, reward whitening, GAE (or group baselines by group id), advantage
        #    whitening
        kl_coef = job.kl_ctl.value
        with span("advantages"):
            advantages, reward_stats = compute_advantages(exp, scores, kl_coef, cfg.algorithm, cfg.distill)
            exp = exp.with_rows("advantages", advantages)
        # 6. PPO epochs x minibatches (`train_minibatch`: its micro-batches, backward, optimizer step), then the
        #    adaptive KL step (OpenAI): the coefficient steers this batch's KL towards the target
        with span("ppo epochs"):
            history = []
            for epoch, number, trajectory_ids in minibatch_order(len(trajectories), settings, step):
                with span(f"ppo epoch {epoch} minibatch {number}"):
                    history.append(train_minibatch(exp.select(trajectory_ids), models, worker, settings, kl_coef))
            metrics.update(update_metrics(history, reward_stats, models, kl_coef))
            job.kl_ctl.update(reward_stats["kl/mean"], len(trajectories))
    progress.at(step + 1, "weight push")
    with timer("sync"):  # 7. new weights into every engine, checked by version and probe logprobs
        metrics.update(push_weights(rt, job, step + 1))
    metrics.update(step_metrics(timer, trajectories, step + 1, job))
    if rt.rank == 0:  # rank 0 logs
        job.sample_rows = sample_rows(job.tokenizer, exp, scores, n=4)
    return metrics


def run_evaluation(job: Job, rt: PPORuntime, step: int) -> dict[str, float]:
    """8. Held-out prompts with the weights of `step` (the engines serve them as version `step`); the sample table
    waits in `job.eval_rows` for the log."""
    evaluation, job.eval_rows = evaluate(job.cfg, rt.rank, job.service, job.reward_model(), job.tokenizer,
                                         job.held_out, step)
    return evaluation


@dataclass
class Job:
    """What the steps use, set up once by `start_job`; rank 0 alone has prompts, logger and service."""
    cfg: PPOConfig
    tokenizer: object
    models: PPOModels
    worker: BatchWorker  # every model's micro-batches on this rank
    settings: StepSettings
    kl_ctl: object  # alg.AdaptiveKLController or alg.FixedKLController
    collector: Collector  # the step's batch, sync or async
    run: TrainingRun  # resume, rank 0's logger and console line, the step loop, checkpoints, the export
    probe: Probe  # the prompt whose logprobs engine and trainer must agree on after each push
    prompts: object = None
    held_out: tuple | None = None
    service: RolloutService | None = None
    probe_gap: float = float("inf")  # the last push's, max over ranks (see StepSettings.old_logprobs_from_engine)
    memory_plan: MemoryPlan | None = None  # its memory_plan/* go into this run's first logged step
    sample_rows: list | None = None  # the last step's sample table, for its log row
    eval_rows: list | None = None  # the last evaluation's sample table, for its log row

    def reward_model(self):
        """Held-out trajectories -> (reward-model scores, rejected), or None without a reward model."""
        if self.models.reward_model is None:
            return None
        return lambda trajectories: reward_model_scores(
            Experience.from_trajectories(trajectories, self.tokenizer.pad_token_id), self.models, self.worker,
            self.settings.scoring)

    def eval_due(self, step: int) -> bool:
        every = self.cfg.eval.every
        return self.cfg.data.eval_path is not None and (step in (0, self.run.total_steps) or bool(every and step % every == 0))


def start_job(cfg: PPOConfig, rt: PPORuntime) -> Job:
    """Everything before the first step, cheapest checks first: a bad import path, model path or
    prompt file costs seconds, not the minutes of loading models and starting engines."""
    env_cls = load_env_class(cfg.env.cls)
    if hasattr(env_cls, "check_kwargs"):  # e.g. AgentEnv's agent import path, before any engine starts
        env_cls.check_kwargs(dict(cfg.env.kwargs))
    for spec in cfg.reward.fns.values():
        load_reward_fn(spec["fn"])
    on_every_rank(lambda: check_model_paths(cfg))
    tokenizer = loading.load_tokenizer(cfg.model.tokenizer_path or cfg.model.path)
    check_teacher(cfg, tokenizer)
    max_positions = loading.model_context_length(cfg.model.path)  # checked against the config at parse time
    seed_everything(rank_seed(cfg.trainer.seed, rt.rank))
    algo, run_dir = cfg.algorithm, Path(cfg.trainer.run_dir)
    total_steps = cfg.trainer.total_episodes // algo.batch_size
    template_kwargs = dict(cfg.env.chat_template_kwargs)  # the dataset's chat prompts render as the envs' turns do
    prompts = on_rank0(lambda: prompt_samples(cfg.data, cfg.data.train_path, tokenizer, algo.batch_size,
                                              algo.group_size, cfg.trainer.seed, cfg.rollout.samples_seeded,
                                              template_kwargs), "read the prompts")
    held_out = None
    if cfg.data.eval_path is not None:
        held_out = on_rank0(lambda: eval_samples(cfg.data, cfg.data.eval_path, tokenizer, cfg.eval.n,
                                                 cfg.eval.max_prompts, template_kwargs), "read the held-out prompts")
    collector = make_collector(cfg, prompts)
    # The memory plan sizes the engines' KV pool and decides whether they release memory each step.
    plan = broadcast_object(on_rank0(lambda: plan_job_memory(cfg, detect_device(rt.device, rt.local_world_size),
                                                             rt.world_size, max_positions), "plan the memory"))
    rt.release_each_step = decide(release_mode(cfg.rollout), plan) and collector.engines_idle_while_training
    if rt.rank == 0 and plan is not None:
        report_plan(plan, rt.release_each_step, run_dir)
    rt.start_engines(cfg.model.path, collector.pauses_in_place, max_positions, plan and plan.kv_tokens)
    models = PPOModels(cfg.model, algo, cfg.reward.model_path or None, tokenizer.pad_token_id, total_steps,
                       cfg.distill)
    # Every model runs the same micro-batches: balanced, length-sorted, packed when asked.
    vision = is_vision_language(cfg.model.path)  # prompts with images: the actor gives their 3-D positions
    if vision and algo.share_prompts:  # (workers/layout.prompt_groups groups rows by their ids alone)
        raise JobError(f"algorithm.share_prompts=true packs the rows of one prompt's ids once, but the prompts of "
                       f"the vision-language policy {cfg.model.path} can show different images under the same ids; "
                       "set algorithm.share_prompts=false")
    worker = BatchWorker.for_job(cfg.model, rt.rank, rt.world_size, rt.device, algo.max_tokens_per_device,
                                 algo.packing, algo.share_prompts, models.actor.model if vision else None)
    truncate_id = None  # OpenAI rejection sampling's truncation token, when a reward model scores
    if cfg.reward.truncate_token is not None and models.reward_model is not None:
        truncate_id = loading.single_token_id(tokenizer, cfg.reward.truncate_token, "reward.truncate_token")
    kl_ctl = (alg.AdaptiveKLController(algo.kl.init_coef, algo.kl.target, algo.kl.horizon)
              if algo.kl.adaptive else alg.FixedKLController(algo.kl.init_coef))
    # Checkpoints hold the trained models, and rank 0's KL controller and place in the prompts.
    run = TrainingRun(cfg, rt.rank, models.trained(), total_steps, ConsoleLine(SHOWN),
                      state=lambda: {"kl_controller": kl_ctl.state_dict(), "prompts": collector.resume_state()}
                      if rt.rank == 0 else None)
    if run.saved:
        kl_ctl.load_state_dict(run.saved["kl_controller"])
        if prompts is not None and run.saved.get("prompts") is not None:
            prompts.load_state_dict(run.saved["prompts"])
    probe = Probe.text(probe_token_ids(tokenizer))
    if vision:  # its push carries the vision tower: the probe shows a picture
        probe = vision_probe(load_processor(cfg.model.path), tokenizer, probe.ids)
    job = Job(cfg, tokenizer, models, worker, StepSettings.from_config(cfg, truncate_id), kl_ctl, collector,
              run, probe, prompts, held_out, memory_plan=plan)
    push_weights(rt, job, run.start_step)  # the engines start from the trainer's (maybe resumed) weights
    if rt.rank == 0:
        job.service = rt.start_rollout_service(tokenizer, rollout_settings(cfg.rollout, max_positions,
                                                                           cfg.trainer.progress))
        collector.start(job.service, rt.dead_engines)
    return job


def push_weights(rt: PPORuntime, job: Job, version: int) -> dict[str, float]:
    """Every rank's engine gets the trainer's weights as `version`, checked by version and the probe's logprobs
    (`RankEngine.push`). Collective: the full tensors are gathered from every rank's shards."""
    models, collector = job.models, job.collector
    with collector.weight_push():
        with span("trainer probe logprobs"):
            trainer_logprobs = models.probe_logprobs(job.probe, job.worker)
        dist.barrier()
        stats = rt.engine.push(models.actor_weights(), version, job.probe, trainer_logprobs, collector.pauses_in_place)
        rt.served_version.set(version)
        dist.barrier()
    job.probe_gap = max_over_ranks(stats["weight_sync/probe_gap"])  # every rank decides the same
    return stats


def step_metrics(timer: StepTimer, trajectories: list, step: int, job: Job) -> dict[str, float]:
    """Phase times and throughput (rank 0 logs them)."""
    if job.run.logger is None:
        return {}
    metrics = timer.metrics()
    step_s = metrics["perf/step_s"]
    metrics.update({"perf/tokens_per_s": sum(t.num_tokens for t in trajectories) / step_s,
                    "perf/episodes_per_s": len(trajectories) / step_s,
                    "episodes": step * job.cfg.algorithm.batch_size, "data/prompts_skipped": job.prompts.skipped})
    return metrics


def log_step(job: Job, step: int, metrics: dict) -> None:
    """Rank 0: the metrics row, the console line, and the sample tables when due (the step's and the
    evaluation's, each handed over once)."""
    run, every = job.run, job.cfg.trainer.log_samples_every
    eval_rows, job.eval_rows = job.eval_rows, None
    sample_rows, job.sample_rows = job.sample_rows, None
    if run.logger is None:
        return
    if step == run.start_step + 1 and job.memory_plan is not None:
        metrics = {**metrics, **job.memory_plan.metrics()}
    run.log(step, metrics, line=step > 0)  # the evaluation's own lines below
    logger = run.logger
    if eval_rows is not None:
        logger.log_samples(step, eval_rows, table="eval_samples")
        print_eval(step, metrics)
    if sample_rows is not None and every and ((step - 1) % every == 0 or step == run.total_steps):
        logger.log_samples(step, sample_rows)


SHOWN = ("reward/score_mean", "reward/fn_total_mean", "kl/mean", "kl/coef", "distill/reverse_kl", "policy/entropy",
         "value/loss", "perf/step_s")  # the console line's metrics, those the step logged


def check_model_paths(cfg: PPOConfig) -> None:
    """A local model path must be a model directory; anything else is a hub name, tried once."""
    for key, value in (("model.path", cfg.model.path), ("reward.model_path", cfg.reward.model_path),
                       ("model.tokenizer_path", cfg.model.tokenizer_path),
                       ("distill.teacher_path", cfg.distill.teacher_path)):
        if value is not None:
            loading.check_model_path(value, key, need_config=key != "model.tokenizer_path")


def check_teacher(cfg: PPOConfig, tokenizer) -> None:
    """On-policy distillation compares logprobs token by token: the local teacher must share the student's
    tokenizer, and a teacher server must answer (rank 0 asks it), before any engine starts."""
    distill = cfg.distill
    if distill.teacher_path is not None:
        check_same_tokenizer(tokenizer, loading.load_tokenizer(distill.teacher_path),
                             cfg.model.tokenizer_path or cfg.model.path, distill.teacher_path)
    if distill.teacher_url is not None:
        on_rank0(RemoteTeacher(distill.teacher_url, distill.teacher_timeout_s).check, "ask the teacher server")


def sample_rows(tokenizer, exp, scores, n: int) -> list[dict]:
    """A few (query, response, score) rows for the samples table."""
    rows = []
    for t, traj in enumerate(exp.trajectories[:n]):
        context, response = traj.final_response()
        rows.append({"query": tokenizer.decode(context, skip_special_tokens=True),
                     "response": tokenizer.decode(response, skip_special_tokens=True),
                     "score": float(scores[t])})
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
