"""One PPO / GRPO step after the rollout, in the order it runs; `rl_core/ppo/job.py` calls these in turn.

1. The batch (`Experience`): the rollout's trajectories become one set of `[N, T]` tensors, a row per
   sequence, built once; each later phase returns its `[N, T]` rows (`STEP_BATCH_ROWS`, the contract) and
   selects rows by index.
2. Forward passes (`forward_passes`, `reward_model_scores`): old and reference logprobs, values and
   reward-model scores, forward only, each micro-batch's outputs from `PPOModels.scoring_outputs`.
3. Rewards (`task_scores`): `rl_core/ppo/scoring.py`'s one definition of a trajectory's score before the KL.
4. Advantages (`compute_advantages`): KL-penalised per-token rewards, whitening, GAE, or group
   baselines, once over the whole batch.
5. PPO epochs (`minibatch_order`, `train_minibatch`, `update_metrics`): epochs x minibatches x micro-batches
   of the clipped losses, each micro-batch's backward in `train_minibatch`. The job's `ppo_step` runs the
   minibatch loop and the adaptive KL step; weight sync follows.

Every per-token quantity is aligned to token positions (see workers/forward.py). Multi-turn
trajectories hold several sequences; advantages run over the chain of all their generated tokens in
order (`Experience.rows`), and the results go back to the sequences' rows (`Experience.split`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from rl_core.distributed import metrics_over_ranks
from rl_core.ppo import algorithms as alg
from rl_core.ppo.config import AlgorithmConfig, DistillConfig, PPOConfig, engine_old_logprobs_max_gap
from rl_core.ppo.distill import distill_advantages
from rl_core.ppo.models import PPOModels
from rl_core.ppo.scoring import Scoring, group_ids, trajectory_scores
from rl_core.ppo.turns import turn_credit, turn_index
from rl_core.rewards.lm_human_preferences import truncation_ends
from rl_core.rollout.trajectory import TokenSequence, Trajectory
from workers import forward, layout
from workers.balance import minibatch_indices
from workers.forward import host_view
from workers.read_back import read_back
from workers.layout import rows_to_batch
from workers.trace import span
from workers.vision import STEP_IMAGE_KEYS, rows_images, step_images
from workers.worker import BatchWorker


@dataclass(frozen=True)
class StepSettings:
    """What the step reads of the config, resolved once."""
    algo: AlgorithmConfig
    scoring: Scoring
    temperature: float  # OpenAI detail: logprobs at the sampling temperature, as the engine sampled
    norm_length: int  # Dr. GRPO's constant loss normaliser: the generation budget of a trajectory
    seed: int
    engine_old_logprobs_max_gap: float  # pi_old is the engine's logprobs when the probe gap is within it

    def old_logprobs_from_engine(self, probe_gap: float) -> bool:
        return probe_gap <= self.engine_old_logprobs_max_gap

    @classmethod
    def from_config(cls, cfg: PPOConfig, truncate_id: int | None) -> "StepSettings":
        ro = cfg.rollout
        return cls(cfg.algorithm, Scoring.from_config(cfg.reward, cfg.algorithm, ro.response_length, truncate_id),
                   ro.temperature, ro.response_length * ro.max_turns, cfg.trainer.seed,
                   engine_old_logprobs_max_gap(cfg))


# --------------------------------------------------------------------------- 1. the batch


# The step batch's contract: the `[N, T]` rows each phase adds. A phase returns its rows and `ppo_step` adds them
# (`Experience.with_rows`, which refuses any other key and any overwrite); later phases select rows by index.
STEP_BATCH_ROWS: dict[str, tuple[str, ...]] = {
    "rollout": ("input_ids", "attention_mask", "position_ids", "action_mask", "behaviour_logprobs", "token_rewards"),
    "forward passes": ("old_logprobs", "ref_logprobs", "values", "teacher_logprobs"),
    "advantages": ("advantages", "returns"),
}


@dataclass(frozen=True)
class Experience:
    """One step's batch, built once at the rollout boundary: every sequence of every trajectory as a
    row of `[N, T]` tensors in `batch`, the keys of `STEP_BATCH_ROWS`, phase by phase; nothing is re-collated.
    `scores` and `rejected` come with the forward passes (the reward model's). Sequences showing images add
    `workers.vision.STEP_IMAGE_KEYS` (every image whole, with its row), which row selections carry along."""
    trajectories: list[Trajectory]
    sequences: list[TokenSequence]
    traj_seqs: list[list[int]]  # row (sequence) indices of every trajectory, in order
    batch: dict[str, torch.Tensor]
    chain: torch.Tensor  # [n_traj, L] flat index into [N, T] of each trajectory's tokens end to end; -1 after
    scores: torch.Tensor | None = None  # [n_traj] reward-model score after gain/bias (0 without a reward model)
    rejected: torch.Tensor | None = None  # [n_traj] no truncation token: gets the fixed penalty instead

    @classmethod
    def from_trajectories(cls, trajectories: list[Trajectory], pad_token_id: int = 0) -> "Experience":
        sequences, traj_seqs = [], []
        for traj in trajectories:
            traj_seqs.append(list(range(len(sequences), len(sequences) + len(traj.sequences))))
            sequences.extend(traj.sequences)
        # attention_mask: a left-padded query keeps its [PAD]s in the row but the engine never saw them.
        batch = rows_to_batch([{"input_ids": s.input_ids, "action_mask": s.action_mask,
                                   "attention_mask": s.attention_mask, "behaviour_logprobs": s.behaviour_logprobs,
                                   "token_rewards": s.token_rewards} for s in sequences], pad_token_id)
        if any(s.pixel_values is not None for s in sequences):  # a text-only batch gets no image keys
            batch.update(step_images([None if s.pixel_values is None else (s.pixel_values, s.image_grid_thw)
                                      for s in sequences]))
        width = batch["input_ids"].shape[1]
        chains = [[s * width + i for s in seqs for i in range(len(sequences[s]))] for seqs in traj_seqs]
        return cls(trajectories, sequences, traj_seqs, batch, layout.pad_rows(chains, max(map(len, chains)), -1,
                                                                              torch.long))

    def with_rows(self, phase: str, rows: dict[str, torch.Tensor], **fields) -> "Experience":
        """This batch with `phase`'s rows added (and any other `fields` set): a new Experience, this one unchanged."""
        unexpected, overwritten = set(rows) - set(STEP_BATCH_ROWS[phase]), set(rows) & set(self.batch)
        if unexpected or overwritten:
            raise ValueError(f"the {phase} phase may add only {STEP_BATCH_ROWS[phase]} to the step batch, each once; "
                             f"it returned {sorted(unexpected)} besides, and {sorted(overwritten)} again")
        return replace(self, batch={**self.batch, **rows}, **fields)

    def rows(self, per_token: torch.Tensor) -> torch.Tensor:
        """`[N, T]` -> `[n_traj, L]`: each trajectory's sequences laid end to end (the GAE chain, prompts
        as holes), 0 after its end."""
        return per_token.flatten()[self.chain.clamp(min=0)].masked_fill(self.chain < 0, 0)

    def split(self, rows: torch.Tensor) -> torch.Tensor:
        """Inverse of `rows`: `[n_traj, L]` -> `[N, T]`."""
        out = torch.zeros(self.batch["input_ids"].numel(), dtype=rows.dtype)
        kept = self.chain >= 0
        out[self.chain[kept]] = rows[kept]
        return out.view(self.batch["input_ids"].shape)

    def select(self, traj_ids: list[int]) -> dict[str, torch.Tensor]:
        """The rows of trajectories `traj_ids` (a minibatch), every tensor of the batch."""
        rows = [s for t in traj_ids for s in self.traj_seqs[t]]
        index = torch.tensor(rows)
        out = {key: value[index] for key, value in self.batch.items() if key not in STEP_IMAGE_KEYS}
        return {**out, **rows_images(self.batch, rows)} if "image_rows" in self.batch else out


# --------------------------------------------------------------------------- 2. forward passes


def forward_passes(exp: Experience, models: PPOModels, worker: BatchWorker, settings: StepSettings,
                   old_from_engine: bool) -> Experience:
    """The batch with `old_logprobs`, `ref_logprobs`, `values` (and a teacher's `teacher_logprobs`) and the reward
    model's scores: forward only, every rank's share gathered to every rank.

    `old_from_engine`: pi_old is the engine's sampling logprobs (the caller checked that engine and
    trainer agree), so only the reference and the critic run, and nothing when neither exists."""
    wanted = {"old_logprobs": not old_from_engine, "ref_logprobs": models.uses_reference,
              "values": models.critic is not None, "teacher_logprobs": models.teacher is not None}
    names = tuple(name for name, needed in wanted.items() if needed)
    rows = {}
    if names:
        with span(f"forward {' '.join(names)}"):
            outputs = worker.compute_and_share(exp.batch, functools.partial(models.scoring_outputs, names, settings.temperature))
            rows.update(zip(names, outputs))
    if models.remote_teacher is not None:
        with span("teacher logprobs"):
            rows["teacher_logprobs"] = models.remote_teacher.logprobs(exp.batch)
    rows.setdefault("old_logprobs", exp.batch["behaviour_logprobs"].clone())
    rows.setdefault("ref_logprobs", rows["old_logprobs"].clone())  # no KL: KL 0
    rows.setdefault("values", torch.zeros_like(rows["old_logprobs"]))
    with span("reward model scores"):
        scores, rejected = reward_model_scores(exp, models, worker, settings.scoring)
    return exp.with_rows("forward passes", rows, scores=scores, rejected=rejected)


def reward_model_scores(exp: Experience, models: PPOModels, worker: BatchWorker,
                        scoring: Scoring) -> tuple[torch.Tensor, torch.Tensor]:
    """Reward-model score of each trajectory (0 without a reward model) and whether it gets the
    rejection penalty instead. Collective when there is a reward model."""
    scores = torch.zeros(len(exp.trajectories))
    rejected = torch.zeros(len(exp.trajectories), dtype=torch.bool)
    if models.reward_model is None:
        return scores, rejected
    rows, rejected = reward_model_rows(exp, scoring.truncate_id, scoring.truncate_after)
    return worker.compute_and_share(rows, models.reward_scores)[0], rejected


def reward_model_rows(exp: Experience, truncate_token: int | None,
                      truncate_after: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The rows the reward model scores, taken from the step's batch, and which trajectories get the
    rejection penalty.

    OpenAI details: the reward model reads query + response (each trajectory's last sequence, whose
    response is its final run of action tokens) and its score is the last token's. Rejection sampling
    cuts the response through its first `truncate_token` at response index >= `truncate_after` (here: the
    attention mask ends there); a response with no such token is read whole and gets a fixed penalty
    instead of its score. The policy still trains on the full sampled response.
    """
    last = torch.tensor([seqs[-1] for seqs in exp.traj_seqs])
    rows = {key: exp.batch[key][last] for key in ("input_ids", "attention_mask", "position_ids")}
    rows["action_mask"] = torch.zeros_like(rows["input_ids"])  # the reward model trains nothing
    if truncate_token is None:
        return rows, torch.zeros(len(last), dtype=torch.bool)
    real, acting = rows["attention_mask"].bool(), exp.batch["action_mask"][last].bool()
    positions = torch.arange(real.shape[1]).expand_as(real)
    end = torch.where(real, positions, -1).amax(dim=1, keepdim=True) + 1  # the sequence's end
    start = torch.where(~acting & (positions < end), positions, -1).amax(dim=1, keepdim=True) + 1  # its response's
    keep_until, rejected = truncation_ends(rows["input_ids"], start, end, truncate_token, truncate_after)
    rows["attention_mask"] = rows["attention_mask"] * (positions < keep_until)
    return rows, rejected


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


# --------------------------------------------------------------------------- 3. rewards


def task_scores(exp: Experience, scoring: Scoring) -> tuple[torch.Tensor, dict[str, float]]:
    """`trajectory_scores` of a scored batch."""
    return trajectory_scores(exp.trajectories, exp.scores, exp.rejected, scoring)


# --------------------------------------------------------------------------- 4. advantages


def compute_advantages(exp: Experience, scores: torch.Tensor, kl_coef: float, algo: AlgorithmConfig,
                       distill: DistillConfig | None = None) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The batch's `advantages` and `returns` rows (`[N, T]`), computed once per step before minibatching, and
    the step's reward statistics.

    `scores` are the per-trajectory scores of `task_scores`. OpenAI details: the KL penalty is
    folded into per-token rewards with the score on the last action token; rewards are whitened
    without shifting their mean; GAE with gamma=1, lambda=0.95; advantages whitened. (OpenAI
    whitens per minibatch; with the recipe's one minibatch that is the same.) Group baselines
    (GRPO/RLOO/REINFORCE) replace GAE for critic-free recipes: groups are found by `group_id`, so
    order and missing members do not matter. With the KL in the loss (`algo.kl.placement`), it is
    left out of the rewards. On-policy distillation (`distill`, when the batch has `teacher_logprobs`) adds
    the teacher's per-token term to the (scaled) reward advantages, before any whitening.
    """
    gamma, lam, kl_estimator, estimator = algo.gamma, algo.lam, algo.kl.estimator, algo.advantage_estimator
    kl_in_reward = algo.kl.placement == "reward"
    batch = exp.batch
    mask = exp.rows(batch["action_mask"]).bool()
    old, ref = exp.rows(batch["old_logprobs"]), exp.rows(batch["ref_logprobs"])
    env_rewards = exp.rows(batch["token_rewards"])
    kl = alg.kl_penalty(old, ref, kl_estimator) * mask
    kl_per_episode = kl.sum(dim=1)
    reward_kl_coef = kl_coef if kl_in_reward else 0.0
    stats = {}
    if estimator == "gae":
        # 1. per-token rewards: -kl_coef * KL on every action token, the score on the last one, env rewards
        rewards = alg.add_kl_penalty(scores, old, ref, mask, reward_kl_coef, kl_estimator) + env_rewards
        total_reward = (rewards * mask).sum(dim=1)  # per episode, before whitening, for logging
        # 2. reward whitening (scale only), 3. GAE over each trajectory's action tokens
        if algo.whiten_rewards:
            rewards = alg.whiten(rewards, shift_mean=False, mask=mask)
        advantages, returns = alg.compute_gae(rewards, exp.rows(batch["values"]), gamma, lam, mask)
    else:
        # 3'. critic-free: one advantage per trajectory from its total reward (score + env, minus the
        # summed KL when it goes in the reward, as RLOO does), put on its action tokens, each turn's
        # discounted by its distance from the last turn under turn_advantage=discounted (rl_core/ppo/turns.py)
        total_reward = scores + env_rewards.sum(dim=1) - reward_kl_coef * kl_per_episode
        ids = group_ids(exp.trajectories)
        advantages = alg.group_advantages(total_reward, ids, estimator, normalize_std=algo.normalize_group_std)
        token_turns = (exp.rows(turn_index(exp.sequences, batch["input_ids"].shape[1]))
                       if algo.turn_advantage == "discounted" else None)
        advantages = turn_credit(advantages, token_turns, mask, algo.turn_advantage, algo.turn_gamma)
        returns = advantages.clone()
        stats = {"groups/zero_variance_frac": alg.zero_variance_groups(total_reward, ids).float().mean().item()}
    if "teacher_logprobs" in batch:  # 3''. on-policy distillation: the teacher's signal on every token
        advantages, distill_stats = distill_advantages(advantages, old, exp.rows(batch["teacher_logprobs"]), mask,
                                                       distill)
        stats.update(distill_stats)
    # 4. advantage whitening
    if algo.whiten_advantages:
        advantages = alg.whiten(advantages, mask=mask)
    stats.update({"kl/mean": kl_per_episode.mean().item(), "reward/total_mean": total_reward.mean().item(),
                  "reward/non_score_mean": (-reward_kl_coef * kl_per_episode).mean().item()})
    return {"advantages": exp.split(advantages), "returns": exp.split(returns)}, stats


# --------------------------------------------------------------------------- 5. PPO epochs


def minibatch_order(n_traj: int, settings: StepSettings, step: int) -> list[tuple[int, int, list[int]]]:
    """`(epoch, number, trajectory indices)` of every minibatch of the step: `noptepochs` passes over freshly
    shuffled minibatches, the same permutation on every rank (ranks must agree on each minibatch's contents).
    Advantages were computed over whole groups before this point, so any split is safe; a batch short of failed
    trajectories gives minibatches that differ in size by at most one."""
    algo = settings.algo
    generator = torch.Generator().manual_seed(settings.seed * 1_000_003 + step)
    return [(epoch, number, minibatch) for epoch in range(algo.noptepochs)
            for number, minibatch in enumerate(minibatch_indices(n_traj, algo.nminibatches, generator))]


def train_minibatch(rows: dict[str, torch.Tensor], models: PPOModels, worker: BatchWorker,
                    settings: StepSettings, kl_coef: float) -> dict:
    """One optimizer step of the actor (and the critic) on a minibatch's rows, their micro-batch loop and backward
    here. Every rank holds the rows and runs its share (`worker.micro_batches`); each micro-batch's summed loss is
    scaled by the minibatch's *global* count (`worker.scaled_loss`). Metrics stay tensors where they were computed:
    a read per optimizer step would stall a GPU each time."""
    algo = settings.algo
    count = alg.global_denominator(rows["action_mask"], algo.loss_agg, settings.norm_length).item()
    micro_batches = worker.micro_batches(rows)  # actor and critic run the same ones
    history: dict[str, list] = {}
    for trainable in models.trained().values():
        trainable.model.train()
    for micro_batch, real in micro_batches:
        loss, metrics = policy_loss(models.actor.model, micro_batch, settings, kl_coef)
        scaled, metrics["policy/loss"] = worker.scaled_loss(loss, count, real)
        scaled.backward()
        if models.critic is not None:
            loss, value_metrics = value_loss(models.critic.model, micro_batch, algo)
            worker.scaled_loss(loss, count, real)[0].backward()
            metrics.update(value_metrics)
        if real:  # a stand-in micro-batch (weight 0) only keeps the ranks' collectives in step
            for key, value in metrics.items():
                history.setdefault(key, []).append(value)
    ran = [host_view(micro_batch) for micro_batch, real in micro_batches if real]
    out = {key: reduce_metric(key, values) for key, values in history.items()}
    out["policy/loss"] = sum(history["policy/loss"])  # this rank's share of the loss: the mean over ranks is it
    out["perf/padding_fraction"] = sum(layout.padding_fraction(b) for b in ran) / max(len(ran), 1)
    out["perf/train_grid_tokens"] = sum(layout.grid_tokens(b) for b in ran)  # positions a rank ran per minibatch
    out["policy/grad_norm"] = models.actor.step()
    if models.critic is not None:
        out["value/grad_norm"] = models.critic.step()
    return out


def update_metrics(history: list[dict], stats: dict[str, float], models: PPOModels, kl_coef: float) -> dict:
    """The PPO epochs' metrics: each optimizer step's (`train_minibatch`) reduced over the steps and then over
    the ranks, read back once, with the advantages' `stats`."""
    per_key: dict[str, list] = {}
    for minibatch in history:
        for key, value in minibatch.items():
            per_key.setdefault(key, []).append(value)
    # Every rank's rows, not rank 0's alone: a rank's loss is its share of the global loss x dp_size, so the
    # mean over ranks is the global loss; the other averages (clip fraction, entropy) become means over ranks.
    out = metrics_over_ranks({k: reduce_metric(k, v) for k, v in read_back(per_key).items()})
    out.update(stats)
    out["kl/coef"] = kl_coef
    out["policy/lr"] = models.actor.current_lr()
    out["policy/optimizer_steps"] = len(history)
    return out


def policy_loss(model, batch: dict[str, torch.Tensor], settings: StepSettings, kl_coef: float):
    """Clipped surrogate (+ entropy bonus, + KL to the reference when it goes in the loss), each token
    weighted for the engine-trainer mismatch (algorithm.rollout_correction), sync and async alike."""
    algo = settings.algo
    logprobs, entropy = forward.token_logprobs_and_entropy(model, batch, settings.temperature,
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
        loss = loss + kl_coef * alg.loss_sum(kl, mask, algo.loss_agg)
        metrics["policy/kl_loss"] = alg.masked_mean(kl.detach(), mask)
    return loss, metrics


def value_loss(model, batch: dict[str, torch.Tensor], algo: AlgorithmConfig):
    """Clipped value loss, weighted by vf_coef."""
    mask = batch["action_mask"]
    per_token, stats = alg.value_loss(forward.token_values(model, batch), batch["values"], batch["returns"], mask,
                                      algo.cliprange_value)
    loss = algo.vf_coef * alg.loss_sum(per_token, mask, algo.loss_agg)
    return loss, {"value/vf_clipfrac": stats["vf_clipfrac"],
                  "value/loss": alg.masked_mean(per_token.detach(), mask)}


def reduce_metric(key: str, values: list):
    """Micro-batch (or minibatch) values of one metric as one: extremes stay extremes, the rest are averaged.
    Numbers give a number; tensors give a tensor on their device, computed there (no host read)."""
    if any(isinstance(v, torch.Tensor) for v in values):
        device = next(v.device for v in values if isinstance(v, torch.Tensor))
        stacked = torch.stack([torch.as_tensor(v, dtype=torch.float32, device=device).reshape(()) for v in values])
        return stacked.amax() if key.endswith("_max") else stacked.amin() if key.endswith("_min") else stacked.mean()
    if key.endswith("_max"):
        return max(values)
    if key.endswith("_min"):
        return min(values)
    return sum(values) / len(values)
