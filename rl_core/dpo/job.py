"""Direct preference optimisation: `torchrun --nproc_per_node N -m rl_core.train_dpo --config dpo_sentiment.yaml [key=value ...]`.

Reads the preference formats of the reward-model job (pairwise, LLaMA-2, OpenAI best-of-N), trains
the policy against a frozen reference (the starting policy, or `model.reference_path`) with the
DPO loss (`dpo.beta`, `dpo.label_smoothing`), on the same FSDP2 worker, config machinery,
checkpoints, metrics and Hugging Face export as the other jobs. Metrics: the loss, the implicit
rewards `beta * (log pi - log ref)` of chosen and rejected responses, their margin and how often
the chosen one wins (reward accuracy), and the response log-likelihoods; on held-out pairs at
step 0, every `eval.every` steps and at the end. With `eval.reward_model_path`, continuations of
held-out prompts are sampled and scored by that reward model (eval/rm_score).
"""

from __future__ import annotations

import sys

import torch

from rl_core.distributed import DataParallel, on_every_rank, rank_seed, seed_everything
from rl_core.dpo.config import DPOConfig, check_models, validate
from rl_core.dpo.training import PreferencePair, heldout_metrics, to_pairs, train_step
from rl_core import finetune
from rl_core.cli import JobEntry, run_job
from rl_core.model_builder import Placement, build_frozen, build_trained
from rl_core.preferences import load_preference_splits
from rl_core.stop_signal import StepProgress
from workers import decode, forward, loading
from workers.layout import rows_to_batch
from workers.worker import BatchWorker


def main(argv: list[str] | None = None, prepare=None) -> None:
    """`prepare(cfg, log)`: the entry point's offline assets, resolved before any process group exists."""
    run_job(argv, JobEntry(__doc__, "dpo_sentiment.yaml", DPOConfig, validate, check_models),
            lambda cfg, lifecycle, progress: train(cfg, lifecycle.data_parallel(), progress), prepare)


def train(cfg: DPOConfig, dp: DataParallel, progress: StepProgress | None = None) -> None:
    """`progress`: where the job is, for the line a stop signal ends with (`run_main`'s)."""
    progress = progress or StepProgress(dp.rank)
    tr, beta, smoothing = cfg.train, cfg.dpo.beta, cfg.dpo.label_smoothing
    reference_path = cfg.model.reference_path or cfg.model.path
    on_every_rank(lambda: [loading.check_model_path(path, key) for key, path in
                           (("model.path", cfg.model.path), ("model.reference_path", reference_path))])
    tokenizer = loading.load_tokenizer(cfg.model.tokenizer_path or cfg.model.path)
    train_examples, test_examples = load_preference_splits(cfg.data, cfg.data.train_path, cfg.data.test_path,
                                                           tokenizer, cfg.trainer.seed)
    train_pairs, test_pairs = to_pairs(train_examples), to_pairs(test_examples)[:cfg.data.eval_max_pairs]
    steps_per_epoch, total_steps = finetune.total_steps(tr, len(train_pairs), "pairs", cfg.data.train_path,
                                                      cfg.trainer.profile_steps)
    if finetune.already_finished(cfg.trainer, tr, steps_per_epoch, total_steps, dp.rank):  # before loading the models
        return
    seed_everything(cfg.trainer.seed)
    trainable = build_trained(cfg.model.path, "causal_lm", cfg.model, Placement(),
                              finetune.optimization(tr, total_steps))
    policy = trainable.model
    reference = build_frozen(reference_path, "causal_lm", cfg.model, Placement())
    worker = BatchWorker.for_job(cfg.model, dp.rank, dp.size, dp.device, tr.max_tokens_per_device, tr.packing)
    scorer = RewardModelEval(cfg, tokenizer, test_pairs, dp) if cfg.eval.reward_model_path else None

    def evaluate() -> dict[str, float]:
        metrics = heldout_metrics(policy, reference, worker, test_pairs, tokenizer.pad_token_id, beta, smoothing)
        return metrics if scorer is None else {**metrics, **scorer(policy)}

    steps = finetune.FixedDataSteps(
        one_step=lambda step: train_step(trainable, reference, worker,
                                         finetune.step_rows(train_pairs, step, tr.batch_size, cfg.trainer.seed),
                                         tokenizer.pad_token_id, beta, smoothing),
        evaluate=evaluate if test_pairs else None, shown=SHOWN)
    banner = f"[dpo] {len(train_pairs)} pairs, {total_steps} steps of {tr.batch_size} on {dp.size} rank(s)"
    finetune.train(steps, "policy", trainable, tokenizer, banner, total_steps, steps_per_epoch, cfg, dp, progress)


SHOWN = ("train/loss", "train/reward_accuracy", "train/reward_margin", "eval/loss", "eval/reward_accuracy",
         "eval/reward_margin", "eval/rm_score", "perf/step_s")


class RewardModelEval:
    """Continuations of held-out prompts sampled from the policy and scored by a reward model (its
    normalised score, as the PPO job reads it). Every rank samples an equal share and holds its own
    copy of the reward model; the seed is fixed, so evaluations differ only by the policy."""

    def __init__(self, cfg: DPOConfig, tokenizer, pairs: list[PreferencePair], dp: DataParallel):
        ev = cfg.eval
        prompts = list(dict.fromkeys(tuple(p.chosen[:p.prompt_length][-ev.query_length:]) for p in pairs))[:ev.prompts]
        mine, padded = dp.share([list(p) for p in prompts])  # padded: equal collectives
        self.mine, self.padded = mine, padded
        self.count = len(prompts)
        self.cfg, self.tokenizer, self.dp, self.seed = ev, tokenizer, dp, rank_seed(cfg.trainer.seed, dp.rank)
        # Padded rows (the reward model's own attention kernel, whatever the policy's layout), balanced over
        # the ranks in micro-batches of at most train.max_tokens_per_device tokens, as training batches are.
        self.worker = BatchWorker(dp.rank, dp.size, dp.device, cfg.train.max_tokens_per_device)
        self.reward_model = build_frozen(ev.reward_model_path, "reward", None, Placement.whole(dp.device),
                                         pad_token_id=tokenizer.pad_token_id)

    @torch.no_grad()
    def __call__(self, policy) -> dict[str, float]:
        policy.eval()
        generator = torch.Generator().manual_seed(self.seed)
        fixed_length = decode.DecodeSettings(self.cfg.response_length, None, temperature=self.cfg.temperature)
        responses = decode.decode(policy, self.padded, fixed_length, self.tokenizer.pad_token_id, self.dp.device,
                                  generator=generator)
        rows = [{"input_ids": q + r, "action_mask": [0] * len(q) + [1] * len(r)}
                for q, r in zip(self.mine, responses)]
        # Every rank's rows, scored by the worker (each rank's own copy of the reward model: no collective inside).
        batch = rows_to_batch(self.dp.concat(rows), self.tokenizer.pad_token_id)
        (scores,) = self.worker.compute_and_share(batch, lambda micro: (forward.reward_scores(self.reward_model, micro),))
        return {"eval/rm_score": float(scores.sum()) / self.count}


if __name__ == "__main__":
    main(sys.argv[1:])
