"""Reward-model training on the one batch worker (`workers.worker`): a comparison's responses are
one unit and the loss is the mean over the global batch's comparisons; one epoch with the LR
annealed to zero, and OpenAI's gain/bias normalisation on reference-policy samples before and
after training."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from rl_core.checkpoint import save_model_directory
from rl_core.config import validate_profile_steps
from rl_core.distributed import DataParallel, rank_seed
from rl_core.logger import progress_bar
from rl_core import model_builder
from rl_core.optim import linear_anneal_schedule
from rl_core.rewards.lm_human_preferences import reward_gain_bias
from rl_core.reward_model.config import NormalizeConfig, RMConfig, RMTrainConfig
from rl_core.reward_model.losses import preference_correct, preference_loss, spearman
from rl_core.reward_model.sampling import pick_queries, sample_truncated
from rl_core.stop_signal import StepProgress
from rl_core.training_run import ConsoleLine, TrainingRun
from workers.fsdp import full_state_dict
from workers.forward import raw_reward_scores, reward_scores
from workers.layout import rows_to_batch
from workers.loading import set_reward_gain_bias
from workers.read_back import read_back
from workers.worker import BatchWorker

Log = Callable[[str], None]


# ----------------------------------------------------------------------------- models


def is_sequence_classifier(path: str) -> bool:
    from transformers import AutoConfig

    architectures = AutoConfig.from_pretrained(path).architectures or []
    return any(name.endswith("ForSequenceClassification") for name in architectures)


def build_reward_model(init_from: str, tokenizer, seed: int, run=None):
    """An existing reward model (head kept) or a fresh one on a causal LM (OpenAI head init), loaded with
    `run`'s keys (the job's `model` section; None: the model's defaults)."""
    kind = "reward" if is_sequence_classifier(init_from) else "new_reward"
    return model_builder.load(init_from, kind, run, pad_token_id=tokenizer.pad_token_id, seed=seed)


# ----------------------------------------------------------------------------- scoring and batches


@torch.no_grad()
def score_sequences(model, sequences: list[list[int]], pad_id: int, worker: BatchWorker,
                    normalized: bool = False) -> torch.Tensor:
    """``[n]`` last-token reward of each query+response id list (raw unless ``normalized``), over the worker's
    token-balanced micro-batches, as training runs them. Every rank passes the whole list and gets every score;
    collective under FSDP."""
    score = reward_scores if normalized else raw_reward_scores
    model.eval()
    batch = rows_to_batch([{"input_ids": ids, "action_mask": [1] * len(ids)} for ids in sequences], pad_id)
    return worker.compute_and_share(batch, lambda micro: (score(model, micro),))[0]


def collate(examples: list, pad_id: int) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
    """The step's batch: every response row of every comparison, in order, each row carrying its
    comparison's best index and margin; and the comparisons as the worker's units (all responses of one
    comparison share a micro-batch)."""
    sizes = {len(example.input_ids) for example in examples}
    if len(sizes) != 1:
        raise ValueError(f"examples with different numbers of responses {sorted(sizes)} in one batch; "
                         "use one preference format per file")
    (responses,) = sizes
    rows = [{"input_ids": ids, "action_mask": [1] * len(ids)} for example in examples for ids in example.input_ids]
    batch = rows_to_batch(rows, pad_id)
    batch["best"] = torch.tensor([example.best for example in examples]).repeat_interleave(responses)
    batch["margin"] = torch.tensor([float(example.margin) for example in examples]).repeat_interleave(responses)
    batch["responses"] = torch.tensor(responses)  # one number for the batch: how to view scores per comparison
    return batch, [list(range(i * responses, (i + 1) * responses)) for i in range(len(examples))]


def comparison_losses(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per comparison: the preference loss of its normalised rewards (the gain scales the loss,
    OpenAI-style), and 1 where the best response scored highest."""
    scores = reward_scores(model, batch).view(-1, int(batch["responses"]))
    best = batch["best"].view(scores.shape)[:, 0]
    margin = batch["margin"].view(scores.shape)[:, 0]
    losses = preference_loss(scores, best, margin if bool(margin.ne(0).any()) else None)
    return losses, preference_correct(scores.detach(), best)


def loss_and_sums(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    losses, correct = comparison_losses(model, batch)
    return losses.sum(), [losses.detach().sum(), correct.sum()]


def heldout_metrics(model, worker: BatchWorker, examples: list, pad_id: int) -> dict[str, float]:
    """Pairwise (best-of-N) accuracy and mean loss over ``examples``, summed over ranks."""
    model.eval()
    batch, units = collate(examples, pad_id)
    loss_sum, correct = worker.sums(batch, lambda b: loss_and_sums(model, b)[1], units)
    return {"accuracy": correct / len(examples), "loss": loss_sum / len(examples)}


# ----------------------------------------------------------------------------- training


@dataclass
class Reporting:
    """Where a reward-model fit reports: `log` its console lines (the step lines among them); `progress` (a
    `rl_core.stop_signal.StepProgress`) its phase and step, for the line a stop signal ends with; `metrics_rows`:
    rank 0 writes each step's row (metrics.jsonl, TensorBoard; the job's, not the offline builders')."""
    log: Log = print
    progress: StepProgress | None = None
    metrics_rows: bool = False


@dataclass
class Epoch:
    """The one epoch on the shared step loop: the seeded order, and the loss and hits summed over ranks so far
    (`totals`, which a checkpoint holds so a resumed run ends with the same sums)."""
    trainable: Any
    worker: BatchWorker
    examples: list
    cfg: RMTrainConfig
    pad_id: int
    order: list[int]
    totals: dict = field(default_factory=lambda: {"loss_sum": 0.0, "correct": 0.0})

    @property
    def steps(self) -> int:  # the last incomplete minibatch is dropped: every step has batch_size comparisons
        return len(self.examples) // self.cfg.batch_size

    def one_step(self, step: int) -> dict[str, float]:
        """Minibatch `step` of the order; its metrics over every rank."""
        size = self.cfg.batch_size

        def loss_fn(model, micro_batch):
            loss, (losses, hits) = loss_and_sums(model, micro_batch)
            return loss, {"loss_sum": losses, "correct": hits}

        batch, units = collate([self.examples[i] for i in self.order[step * size:(step + 1) * size]], self.pad_id)
        metrics, _ = self.worker.forward_backward(self.trainable, batch, loss_fn, size, units)
        lr = self.trainable.current_lr()
        metrics = read_back({**metrics, "grad_norm": [self.trainable.step()]})  # the step's one read from the device
        loss_sum, correct = self.worker.sum_over_ranks([sum(metrics["loss_sum"]), sum(metrics["correct"])])
        self.totals["loss_sum"] += loss_sum
        self.totals["correct"] += correct
        seen = (step + 1) * size
        return {"train/loss": loss_sum / size, "train/accuracy": correct / size, "train/lr": lr,
                "train/grad_norm": metrics["grad_norm"][0],
                "epoch/loss": self.totals["loss_sum"] / seen, "epoch/accuracy": self.totals["correct"] / seen}

    def results(self) -> dict[str, float]:
        seen = self.steps * self.cfg.batch_size
        return {"train_loss": self.totals["loss_sum"] / seen, "train_accuracy": self.totals["correct"] / seen,
                "train_steps": self.steps}


SHOWN = ("train/lr", "train/grad_norm", "epoch/loss", "epoch/accuracy")  # the console line's metrics


def _mark_invalid(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """NaN where a sample is not scored (its response has no truncate token); the statistics drop them."""
    return torch.where(valid, scores, torch.full_like(scores, float("nan")))


def _valid_only(scores: torch.Tensor, cfg: NormalizeConfig) -> torch.Tensor:
    scores = scores[~scores.isnan()]
    if scores.numel() < 2:
        raise ValueError(f"only {scores.numel()} of the reference-policy samples had normalize.truncate_token="
                         f"{cfg.truncate_token!r} at or after token {cfg.truncate_after}; raise normalize.num_samples, "
                         "lower normalize.truncate_after, or set normalize.truncate_token=null")
    return scores


@dataclass(frozen=True)
class ReferenceSamples:
    """What the reward's normalisation and its fresh-sample check score: the reference `policy`'s
    continuations of `queries` (token ids of `tokenizer`), sampled and truncated as `cfg` says, each
    rank its share of `dp`."""

    policy: Any
    tokenizer: Any
    queries: list[list[int]]
    cfg: NormalizeConfig
    dp: DataParallel

    def scored(self, model, worker: BatchWorker, seed: int, desc: str | None,
               normalized: bool = False) -> tuple[list, torch.Tensor]:
        """This rank's responses, and every rank's scores of every rank's responses, in rank order (NaN where a
        sample is not scored)."""
        cfg, dp = self.cfg, self.dp
        mine = pick_queries(self.queries, cfg.num_samples, seed, dp.rank, dp.size)
        responses, valid = sample_truncated(self.policy, self.tokenizer, mine, cfg, rank_seed(seed, dp.rank), desc)
        sequences = dp.concat([q + r for q, r in zip(mine, responses)])
        scores = score_sequences(model, sequences, self.tokenizer.pad_token_id, worker, normalized=normalized)
        return responses, _mark_invalid(scores, dp.gather(valid.float()).bool())


def normalize_reward(model, reference: ReferenceSamples, worker: BatchWorker, seed: int,
                     desc: str | None = None) -> tuple[float, float]:
    """Set gain/bias so rewards of reference-policy samples have mean 0, std 1 (OpenAI detail)."""
    _, raw = reference.scored(model, worker, seed, desc)
    gain, bias = reward_gain_bias(_valid_only(raw, reference.cfg))
    set_reward_gain_bias(model, gain, bias)
    return gain, bias


def fresh_sample_check(model, reference: ReferenceSamples, worker: BatchWorker, seed: int, labeler=None,
                       desc: str | None = None) -> dict[str, float | None]:
    """Normalised reward statistics on a new sample, and Spearman with the labeler's score."""
    responses, scores = reference.scored(model, worker, seed, desc, normalized=True)
    kept = ~scores.isnan()
    scores = _valid_only(scores, reference.cfg)
    result: dict[str, float | None] = {"normalized_mean": scores.mean().item(),
                                       "normalized_std": scores.std(unbiased=False).item(),
                                       "fresh_samples": int(kept.sum()), "spearman": None}
    if labeler is not None:
        # The rater judges the (truncated) continuation only, as when labelling (the query is shared).
        texts = reference.tokenizer.batch_decode(responses, skip_special_tokens=False)
        judged = reference.dp.gather(torch.tensor(labeler.score(texts), dtype=torch.float32))
        result["spearman"] = spearman(scores, judged[kept])
    return result


def fit_reward_model(model, reference: ReferenceSamples, train_examples: list, test_examples: list,
                     cfg: RMConfig, labeler=None, reporting: Reporting = Reporting()) -> dict:
    """Normalise on `reference`'s samples, train one epoch, normalise again, check on a fresh sample.
    Returns metrics.

    ``reference.dp.sharded``: the model is sharded with FSDP2 over the default process group here;
    otherwise it trains as a plain module in this process.
    """
    tokenizer, dp, tr = reference.tokenizer, reference.dp, cfg.trainer
    steps = len(train_examples) // cfg.train.batch_size
    if steps < 1:
        raise ValueError(f"the train set has {len(train_examples)} comparisons, fewer than one minibatch "
                         f"(train.batch_size={cfg.train.batch_size}); lower train.batch_size or add data")
    validate_profile_steps(tr.profile_steps, steps, f"{len(train_examples)} comparisons / train.batch_size="
                                                    f"{cfg.train.batch_size}, one epoch")
    placement = model_builder.Placement() if dp.sharded else model_builder.Placement.whole(dp.device)
    # OpenAI: one epoch, LR annealed linearly to zero.
    optimization = model_builder.Optimization.from_config(
        cfg.train, lambda optimizer: linear_anneal_schedule(optimizer, steps))
    trainable = model_builder.make_trainable(model, cfg.model, placement, optimization)
    model, pad_id = trainable.model, tokenizer.pad_token_id
    # Bars (with ETAs) on rank 0: on a CPU each sampling phase can take minutes.
    show = tr.progress and dp.rank == 0
    bar = (lambda what: f"[train_rm] {what}") if show else (lambda what: None)
    worker = BatchWorker.for_job(cfg.model, dp.rank, dp.size, dp.device, cfg.train.max_tokens_per_device,
                                 cfg.train.packing)
    epoch = Epoch(trainable, worker, train_examples, cfg.train, pad_id,
                  torch.randperm(len(train_examples), generator=torch.Generator().manual_seed(tr.seed)).tolist())
    before_training: dict = {}  # the first normalisation's gain and bias, the held-out baseline
    # A checkpoint holds the weights, optimizer, schedule and RNG mid-epoch, what came before training and the
    # epoch's sums so far: a resumed run goes on from its step as if never stopped.
    run = TrainingRun(cfg, dp.rank, {"reward_model": trainable}, steps,
                      ConsoleLine(SHOWN, every=cfg.train.log_every, prefix="[train_rm] ", say=reporting.log),
                      state=lambda: {**before_training, **epoch.totals}, rows=reporting.metrics_rows)
    progress = reporting.progress or StepProgress(dp.rank)
    try:
        if run.start_step:
            before_training.update({key: run.saved[key] for key in ("gain_before", "bias_before", "before")})
            epoch.totals.update(loss_sum=run.saved["loss_sum"], correct=run.saved["correct"])
            set_reward_gain_bias(model, before_training["gain_before"], before_training["bias_before"])
        else:
            # OpenAI: normalise before training too, so the loss sees rewards at unit scale from step one.
            progress.at(None, "normalisation before training")
            gain, bias = normalize_reward(model, reference, worker, tr.seed, bar("sampling to normalise before training"))
            before_training.update(gain_before=gain, bias_before=bias,
                                   before=heldout_metrics(model, worker, test_examples, pad_id))
        reporting.log(f"[train_rm] {len(train_examples)} train / {len(test_examples)} held-out comparisons, {steps} "
                      f"steps on {dp.size} rank(s); held-out accuracy before training "
                      f"{before_training['before']['accuracy']:.3f}")
        # A bar (with its ETA) on rank 0 as well: on a CPU the epoch can take minutes.
        with progress_bar(total=steps, initial=run.start_step, desc="[train_rm] training the reward model",
                          unit="step", enabled=show) as steps_bar:

            def one_step(step: int) -> dict[str, float]:
                metrics = epoch.one_step(step)
                steps_bar.update()
                return metrics

            run.run_steps(one_step, dp.device, progress)
    finally:
        run.close()
    progress.at(None, "evaluation and normalisation after training")
    after = heldout_metrics(model, worker, test_examples, pad_id)
    gain, bias = normalize_reward(model, reference, worker, tr.seed + 1, bar("sampling to normalise after training"))
    check = fresh_sample_check(model, reference, worker, tr.seed + 2, labeler,
                               bar("sampling to check on fresh samples"))
    return {"heldout_accuracy": after["accuracy"], "heldout_loss": after["loss"],
            "heldout_accuracy_before": before_training["before"]["accuracy"], **epoch.results(),
            "gain_before": before_training["gain_before"],
            "gain": gain, "bias": bias, **check}


def export_reward_model(model, tokenizer, out_dir: str | Path, dp: DataParallel) -> None:
    """Hugging Face seq-cls checkpoint + tokenizer on rank 0, written whole or not at all; gain/bias ride in the
    config."""
    from transformers import AutoModelForSequenceClassification


    state = full_state_dict(model) if dp.sharded else None  # collective: every rank gathers
    if dp.rank != 0:
        return
    if state is not None:
        plain = AutoModelForSequenceClassification.from_config(copy.deepcopy(model.config))
        plain.load_state_dict(state)
        model = plain
    save_model_directory(model, tokenizer, Path(out_dir))


# ----------------------------------------------------------------------------- preference data
