"""Reward-model training job: learn a scalar reward from preference comparisons.

    torchrun --nproc_per_node 2 -m rl_core.train_rm --config rm_sentiment.yaml [key=value ...]
    python -m rl_core.train_rm --config rm_sentiment.yaml          # a world of one

Follows Ziegler et al. (2019) / lm-human-preferences: the reward is the score head's output at
the last token of query+response; before and after training the reward is affinely normalised
(gain, bias) so that responses sampled from the reference policy score mean 0 and std 1; one
epoch with the learning rate annealed linearly to zero, because labels are scarce and a second
pass overfits them. Training runs on the same FSDP2 worker as PPO, over token-balanced
micro-batches with the global loss-scaling rule. The checkpoint is a Hugging Face
sequence-classification model (num_labels=1) with ``reward_gain``/``reward_bias`` in its config.

The last line printed is one JSON object with the results (held-out accuracy, Spearman
correlation with the labeler on fresh samples, gain, bias, normalised mean/std, output_dir).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import json
import math
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from rl_core.assets import file_lock, settings_match, staged_directory, torch_threads
from rl_core.config import ConfigError, save_config

Log = Callable[[str], None]

LABELER_NAMES = (None, "sentiment", "descriptiveness")
RM_BUILD_FORMAT = 2


# ----------------------------------------------------------------------------- config schema


@dataclass
class RMModelConfig:
    # Reference policy: its tokenizer, and the sampler for reward normalisation. "tiny" = assets policy.
    policy_path: str = "tiny"
    # Starting weights: null = policy_path; any HF causal LM (fresh head) or seq-cls checkpoint (kept head).
    init_from: Optional[str] = None
    mixed_precision: Optional[str] = None  # None | bf16 | fp16 (GPU only)


@dataclass
class RMDataConfig:
    # "tiny" = offline labels (policy samples judged by the labeler), built if missing.
    train_path: str = "tiny"
    # "tiny" goes with a tiny train set; null = hold out heldout_fraction of the train file.
    test_path: Optional[str] = "tiny"
    heldout_fraction: float = 0.1
    format: str = "auto"  # auto | pairwise | llama2 | openai
    margin_map: Optional[dict] = None  # LLaMA-2 prefer_degree -> margin; null = margins off
    max_length: int = 128  # prompt + response tokens per row
    on_malformed: str = "error"  # error | skip


@dataclass
class RMTrainConfig:
    batch_size: int = 32  # comparisons per optimizer step
    lr: float = 5e-5
    optimizer: str = "adam"  # adam | adamw | tf_adam
    adam_eps: float = 1e-5
    max_grad_norm: Optional[float] = None
    max_tokens_per_device: int = 4096
    log_every: int = 10
    collective_timeout_s: float = 600.0


@dataclass
class NormalizeConfig:
    # Queries the reference policy continues: "tiny" = assets train prompts, else a jsonl with text_key.
    prompts_path: str = "tiny"
    text_key: str = "text"
    num_samples: int = 256
    query_length: int = 64
    response_length: int = 24
    temperature: float = 1.0
    batch_size: int = 64
    # OpenAI rejection sampling, as the PPO job applies it before scoring: each response is cut at
    # its first truncate_token at/after index truncate_after, and one without it is not scored
    # (PPO gives it a fixed penalty instead). null = score whole responses.
    truncate_token: Optional[str] = "."
    truncate_after: int = 16


@dataclass
class LabelerConfig:
    # Offline rater ("sentiment" | "descriptiveness" | null): labels "tiny" data, and its score is
    # what the reward model's ranking is compared with (Spearman) on fresh samples.
    name: Optional[str] = "sentiment"
    noise: float = 0.0  # flip probability for the offline labels


@dataclass
class RMJobConfig:
    seed: int = 1
    model: RMModelConfig = field(default_factory=RMModelConfig)
    data: RMDataConfig = field(default_factory=RMDataConfig)
    train: RMTrainConfig = field(default_factory=RMTrainConfig)
    normalize: NormalizeConfig = field(default_factory=NormalizeConfig)
    labeler: LabelerConfig = field(default_factory=LabelerConfig)
    run_dir: str = "runs/rm_sentiment"
    output_dir: Optional[str] = None  # null = <run_dir>/reward_model


_CHOICES = {
    "data.format": ("auto", "pairwise", "llama2", "openai"),
    "data.on_malformed": ("error", "skip"),
    "train.optimizer": ("adam", "adamw", "tf_adam"),
    "model.mixed_precision": (None, "bf16", "fp16"),
    "labeler.name": LABELER_NAMES,
}


def _lookup(cfg: RMJobConfig, key: str):
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def validate_rm_config(cfg: RMJobConfig) -> None:
    """Cross-field rules of the reward-model job; raises ConfigError naming the key and the fix."""
    for key, allowed in _CHOICES.items():
        value = _lookup(cfg, key)
        shown = ", ".join("null" if a is None else str(a) for a in allowed)
        _require(value in allowed, f"config key '{key}' = {value!r} is not one of: {shown}")
    tr, norm, data = cfg.train, cfg.normalize, cfg.data
    _require(cfg.seed >= 0, f"config key 'seed' must be >= 0, got {cfg.seed}")
    _require(tr.batch_size > 0, f"config key 'train.batch_size' must be > 0, got {tr.batch_size}")
    _require(tr.lr > 0, f"config key 'train.lr' must be > 0, got {tr.lr}")
    _require(tr.adam_eps > 0, f"config key 'train.adam_eps' must be > 0, got {tr.adam_eps}")
    _require(tr.max_grad_norm is None or tr.max_grad_norm > 0,
             f"config key 'train.max_grad_norm' must be > 0 or null, got {tr.max_grad_norm}")
    _require(tr.log_every > 0, f"config key 'train.log_every' must be > 0, got {tr.log_every}")
    _require(tr.collective_timeout_s > 0, "config key 'train.collective_timeout_s' must be > 0")
    _require(data.max_length >= 2, f"config key 'data.max_length' must be >= 2, got {data.max_length}")
    # A comparison has at least two responses and must fit one micro-batch whole.
    _require(tr.max_tokens_per_device >= 2 * data.max_length,
             f"train.max_tokens_per_device={tr.max_tokens_per_device} cannot hold one comparison of two "
             f"rows of data.max_length={data.max_length}; raise it to at least {2 * data.max_length}")
    _require(0.0 < data.heldout_fraction < 1.0,
             f"config key 'data.heldout_fraction' must be in (0, 1), got {data.heldout_fraction}")
    _require(norm.num_samples >= 2, f"config key 'normalize.num_samples' must be >= 2, got {norm.num_samples}")
    _require(norm.query_length > 0, "config key 'normalize.query_length' must be > 0")
    _require(norm.response_length > 0, "config key 'normalize.response_length' must be > 0")
    _require(norm.temperature > 0, f"config key 'normalize.temperature' must be > 0, got {norm.temperature}")
    _require(norm.batch_size > 0, "config key 'normalize.batch_size' must be > 0")
    _require(norm.truncate_token is None or 0 <= norm.truncate_after < norm.response_length,
             f"normalize.truncate_after={norm.truncate_after} must be in [0, normalize.response_length="
             f"{norm.response_length}) so a response can hold the truncate token; or set normalize.truncate_token=null")
    _require(0.0 <= cfg.labeler.noise <= 1.0,
             f"config key 'labeler.noise' must be a probability in [0, 1], got {cfg.labeler.noise}")
    _require(data.train_path != "tiny" or cfg.labeler.name is not None,
             "data.train_path=tiny labels samples offline and needs a labeler; set labeler.name="
             "sentiment or labeler.name=descriptiveness, or point data.train_path at a preference file")
    _require(data.test_path != "tiny" or data.train_path == "tiny",
             "data.test_path=tiny is the held-out half of the tiny labels; with your own data.train_path "
             "give a data.test_path file, or null to hold out data.heldout_fraction of the train file")


# ----------------------------------------------------------------------------- data parallel


@dataclass(frozen=True)
class DataParallel:
    """This process's place among the trainers.

    ``sharded=False`` trains alone without any torch.distributed call, even when a process
    group exists (the tiny-RM bootstrap runs on one rank of the PPO job).
    """

    rank: int = 0
    size: int = 1
    sharded: bool = False
    device: torch.device = torch.device("cpu")

    def sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum of ``values`` over ranks."""
        if not self.sharded or self.size == 1:
            return [float(v) for v in values]
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor)
        return tensor.tolist()

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """Concatenate equally long 1-D tensors from every rank, in rank order."""
        if not self.sharded or self.size == 1:
            return values
        values = values.to(self.device).contiguous()
        parts = [torch.empty_like(values) for _ in range(self.size)]
        dist.all_gather(parts, values)
        return torch.cat(parts).cpu()

    def barrier(self) -> None:
        if self.sharded and self.size > 1:
            dist.barrier()


# ----------------------------------------------------------------------------- models


def is_sequence_classifier(path: str) -> bool:
    from transformers import AutoConfig

    architectures = AutoConfig.from_pretrained(path).architectures or []
    return any(name.endswith("ForSequenceClassification") for name in architectures)


def build_reward_model(init_from: str, tokenizer, seed: int):
    """An existing reward model (head kept) or a fresh one on a causal LM (OpenAI head init)."""
    from workers.models import init_reward_model, load_reward_model

    if is_sequence_classifier(init_from):
        return load_reward_model(init_from, pad_token_id=tokenizer.pad_token_id)
    return init_reward_model(init_from, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                             seed=seed)


def context_length(model) -> int | None:
    config = model.config
    return getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)


def check_lengths(cfg: RMJobConfig, max_positions: int | None) -> None:
    """The model must hold the longest preference row and the longest normalisation sample."""
    if max_positions is None:
        return
    _require(cfg.data.max_length <= max_positions,
             f"data.max_length={cfg.data.max_length} exceeds the model's context of {max_positions} "
             f"tokens; set data.max_length<={max_positions}")
    longest = cfg.normalize.query_length + cfg.normalize.response_length
    _require(longest <= max_positions,
             f"normalize.query_length + normalize.response_length = {longest} exceeds the model's context "
             f"of {max_positions} tokens; shorten normalize.query_length")


# ----------------------------------------------------------------------------- sampling


def load_queries(path: str | Path, text_key: str, tokenizer, query_length: int) -> list[list[int]]:
    """Token ids of each prompt in a jsonl file, cut to ``query_length`` tokens."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"prompt file {path} does not exist; set normalize.prompts_path to a jsonl file "
                         f"with a '{text_key}' field per line, or to 'tiny'")
    texts = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                texts.append(json.loads(line)[text_key])
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{path}: line {number} is not a JSON object with a '{text_key}' field; "
                                 f"fix it or set normalize.text_key") from None
    ids = [row[:query_length] for row in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    ids = [row for row in ids if row]
    if not ids:
        raise ValueError(f"{path} has no non-empty prompts")
    return ids


def _left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row)
        mask[i, width - len(row):] = 1
    return ids, mask


@torch.no_grad()
def sample_responses(policy, tokenizer, queries: list[list[int]], response_length: int,
                     temperature: float, seed: int, batch_size: int = 64) -> list[list[int]]:
    """Fixed-length continuations of each query from the reference policy.

    OpenAI details: sampling with top_k=0 / top_p=1 at the given temperature, and exactly
    ``response_length`` tokens: EOS does not stop a sample (``eos_token_id=[]``).
    The global RNG is restored afterwards, so callers' random streams are untouched.
    """
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                              max_new_tokens=response_length, eos_token_id=[],
                              pad_token_id=tokenizer.pad_token_id)
    device = next(policy.parameters()).device
    devices = [device] if device.type == "cuda" else []
    responses: list[list[int]] = []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        for start in range(0, len(queries), batch_size):
            ids, mask = _left_pad(queries[start:start + batch_size], tokenizer.pad_token_id)
            out = policy.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                  generation_config=config)
            responses.extend(out[:, ids.shape[1]:].tolist())
    return responses


def sample_truncated(policy, tokenizer, queries: list[list[int]], cfg: NormalizeConfig,
                     seed: int) -> tuple[list[list[int]], torch.Tensor]:
    """Reference-policy responses as the PPO job's reward model reads them, and which are scored.

    OpenAI rejection sampling: each response is cut through its first ``cfg.truncate_token`` at
    or after ``cfg.truncate_after``; a response without one keeps its full length and is marked
    not valid (PPO penalises it instead of scoring it).
    """
    from rl_core.algorithms import truncated_ids
    from workers.models import single_token_id

    responses = sample_responses(policy, tokenizer, queries, cfg.response_length, cfg.temperature, seed,
                                 cfg.batch_size)
    if cfg.truncate_token is None:
        return responses, torch.ones(len(responses), dtype=torch.bool)
    token = single_token_id(tokenizer, cfg.truncate_token, "normalize.truncate_token")
    cut = [truncated_ids(response, token, cfg.truncate_after) for response in responses]
    valid = torch.tensor([c is not None for c in cut], dtype=torch.bool)
    return [c if c is not None else r for c, r in zip(cut, responses)], valid


def pick_queries(queries: list[list[int]], num: int, seed: int, dp: DataParallel) -> list[list[int]]:
    """This rank's share of ``num`` queries drawn (with repeats if needed) from the whole set.

    Every rank gets the same count, ``ceil(num / dp.size)``, so forward passes line up.
    """
    per_rank = math.ceil(num / dp.size)
    generator = torch.Generator().manual_seed(seed)
    rounds = math.ceil(per_rank * dp.size / len(queries))
    order = torch.cat([torch.randperm(len(queries), generator=generator) for _ in range(rounds)])
    mine = order[dp.rank * per_rank:(dp.rank + 1) * per_rank]
    return [queries[i] for i in mine.tolist()]


# ----------------------------------------------------------------------------- scoring and batches


def _to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {key: value.to(device) for key, value in batch.items()}


@torch.no_grad()
def score_sequences(model, sequences: list[list[int]], pad_id: int, device: torch.device,
                    chunk: int = 64, normalized: bool = False) -> torch.Tensor:
    """``[n]`` last-token reward of each query+response id list (raw unless ``normalized``).

    Collective under FSDP: every rank must pass the same number of sequences.
    """
    from workers.models import make_micro_batch, raw_reward_scores, reward_scores

    score = reward_scores if normalized else raw_reward_scores
    model.eval()
    out = []
    for start in range(0, len(sequences), chunk):
        rows = [{"input_ids": ids, "action_mask": [1] * len(ids)} for ids in sequences[start:start + chunk]]
        batch = _to_device(make_micro_batch(rows, pad_id), device)
        out.append(score(model, batch["input_ids"], batch["attention_mask"], batch["position_ids"]).float().cpu())
    return torch.cat(out)


def example_tokens(example) -> int:
    """Balancing weight of a comparison: all its responses go to one micro-batch together."""
    return sum(len(ids) for ids in example.input_ids)


def collate_examples(examples: list, pad_id: int, weight: float = 1.0) -> dict[str, torch.Tensor]:
    """One micro-batch: every response row of every example, plus best index, margin and weight."""
    from workers.models import make_micro_batch

    sizes = {len(example.input_ids) for example in examples}
    if len(sizes) != 1:
        raise ValueError(f"examples with different numbers of responses {sorted(sizes)} in one batch; "
                         "use one preference format per file")
    rows = [{"input_ids": ids, "action_mask": [1] * len(ids)} for example in examples for ids in example.input_ids]
    batch = make_micro_batch(rows, pad_id)
    batch["best"] = torch.tensor([example.best for example in examples], dtype=torch.long)
    batch["margin"] = torch.tensor([example.margin for example in examples], dtype=torch.float32)
    batch["weight"] = torch.tensor(weight, dtype=torch.float32)
    return batch


def micro_batches_for_rank(examples: list, dp: DataParallel, max_tokens: int, pad_id: int) -> list[dict]:
    """This rank's token-balanced micro-batches of whole comparisons.

    An empty partition still runs a zero-weight forward/backward on a stand-in example:
    FSDP's collectives need every rank to do the same number of passes.
    """
    from rl_core.balance import balanced_partitions, partitions_for_rank

    weights = [example_tokens(example) for example in examples]
    if max(weights) > max_tokens:
        raise ValueError(f"a comparison has {max(weights)} tokens (all its responses together) but "
                         f"train.max_tokens_per_device={max_tokens}; raise it or lower data.max_length")
    parts = partitions_for_rank(balanced_partitions(weights, dp.size, max_tokens), dp.rank, dp.size)
    batches = []
    for part in parts:
        chosen, weight = (part, 1.0) if part else ([0], 0.0)
        batches.append(_to_device(collate_examples([examples[i] for i in chosen], pad_id, weight), dp.device))
    return batches


def comparison_scores(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[examples, responses]`` normalised rewards (the gain scales the loss, OpenAI-style)."""
    from workers.models import reward_scores

    scores = reward_scores(model, batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    return scores.view(batch["best"].shape[0], -1)


def _margin(batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
    return batch["margin"] if bool(batch["margin"].ne(0).any()) else None


def _correct(scores: torch.Tensor, best: torch.Tensor) -> float:
    from rl_core.rm_losses import preference_accuracy

    return preference_accuracy(scores.detach(), best) * best.shape[0]


def preference_loss_fn(global_count: int, dp_size: int):
    """Loss for ``TrainableModel.forward_backward``.

    Loss scaling (design invariant): ranks hold different numbers of comparisons, so each rank
    sums its per-example losses, divides by the *global* count and multiplies by dp_size,
    because FSDP averages gradients over ranks.
    """
    from rl_core.rm_losses import preference_loss

    def loss_fn(model, batch):
        scores = comparison_scores(model, batch)
        losses = preference_loss(scores, batch["best"], _margin(batch))
        weight = batch["weight"]
        loss = losses.sum() * weight / global_count * dp_size
        return loss, {"loss_sum": losses.detach().sum() * weight,
                      "correct": _correct(scores, batch["best"]) * float(weight)}

    return loss_fn


@torch.no_grad()
def heldout_metrics(model, examples: list, dp: DataParallel, max_tokens: int, pad_id: int) -> dict[str, float]:
    """Pairwise (best-of-N) accuracy and mean loss over ``examples``, summed over ranks."""
    from rl_core.rm_losses import preference_loss

    model.eval()
    correct = loss_sum = 0.0
    for batch in micro_batches_for_rank(examples, dp, max_tokens, pad_id):
        scores = comparison_scores(model, batch)
        weight = float(batch["weight"])
        loss_sum += float(preference_loss(scores, batch["best"], _margin(batch)).sum()) * weight
        correct += _correct(scores, batch["best"]) * weight
    correct, loss_sum = dp.sum([correct, loss_sum])
    return {"accuracy": correct / len(examples), "loss": loss_sum / len(examples)}


# ----------------------------------------------------------------------------- training


def train_one_epoch(trainable, examples: list, cfg: RMTrainConfig, dp: DataParallel, pad_id: int,
                    seed: int, log: Log) -> dict[str, float]:
    """One shuffled pass; the last incomplete minibatch is dropped (every step has batch_size examples)."""
    steps = len(examples) // cfg.batch_size
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed)).tolist()
    loss_sum = correct = 0.0
    for step in range(steps):
        minibatch = [examples[i] for i in order[step * cfg.batch_size:(step + 1) * cfg.batch_size]]
        micro_batches = micro_batches_for_rank(minibatch, dp, cfg.max_tokens_per_device, pad_id)
        metrics = trainable.forward_backward(micro_batches, preference_loss_fn(len(minibatch), dp.size))
        lr = trainable.current_lr()
        grad_norm = trainable.step()
        loss_sum += sum(metrics["loss_sum"])
        correct += sum(metrics["correct"])
        if (step + 1) % cfg.log_every == 0 or step + 1 == steps:
            seen = (step + 1) * cfg.batch_size / dp.size
            log(f"[train_rm] step {step + 1}/{steps} lr {lr:.2e} grad_norm {grad_norm:.3f} "
                f"loss {loss_sum / seen:.4f} acc {correct / seen:.3f} (rank {dp.rank} running means)")
    loss_sum, correct = dp.sum([loss_sum, correct])
    seen = steps * cfg.batch_size
    return {"train_loss": loss_sum / seen, "train_accuracy": correct / seen, "train_steps": steps}


def _mark_invalid(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """NaN where a sample is not scored; ranks gather equal lengths, then drop the NaNs."""
    return torch.where(valid, scores, torch.full_like(scores, float("nan")))


def _valid_only(scores: torch.Tensor, cfg: NormalizeConfig) -> torch.Tensor:
    scores = scores[~scores.isnan()]
    if scores.numel() < 2:
        raise ValueError(f"only {scores.numel()} of the reference-policy samples had normalize.truncate_token="
                         f"{cfg.truncate_token!r} at or after token {cfg.truncate_after}; raise normalize.num_samples, "
                         "lower normalize.truncate_after, or set normalize.truncate_token=null")
    return scores


def normalize_reward(model, policy, tokenizer, queries: list[list[int]], cfg: NormalizeConfig,
                     seed: int, dp: DataParallel) -> tuple[float, float]:
    """Set gain/bias so rewards of reference-policy samples have mean 0, std 1 (OpenAI detail)."""
    from rl_core.algorithms import reward_gain_bias
    from workers.fsdp import rank_seed
    from workers.models import set_reward_gain_bias

    mine = pick_queries(queries, cfg.num_samples, seed, dp)
    responses, valid = sample_truncated(policy, tokenizer, mine, cfg, rank_seed(seed, dp.rank))
    sequences = [q + r for q, r in zip(mine, responses)]
    raw = score_sequences(model, sequences, tokenizer.pad_token_id, dp.device, cfg.batch_size)
    raw = _valid_only(dp.gather(_mark_invalid(raw, valid)), cfg)
    gain, bias = reward_gain_bias(raw)
    set_reward_gain_bias(model, gain, bias)
    return gain, bias


def fresh_sample_check(model, policy, tokenizer, queries: list[list[int]], cfg: NormalizeConfig,
                       seed: int, dp: DataParallel, labeler=None) -> dict[str, float | None]:
    """Normalised reward statistics on a new sample, and Spearman with the labeler's score."""
    from rl_core.rm_losses import spearman
    from workers.fsdp import rank_seed

    mine = pick_queries(queries, cfg.num_samples, seed, dp)
    responses, valid = sample_truncated(policy, tokenizer, mine, cfg, rank_seed(seed, dp.rank))
    sequences = [q + r for q, r in zip(mine, responses)]
    scores = score_sequences(model, sequences, tokenizer.pad_token_id, dp.device, cfg.batch_size, normalized=True)
    scores = dp.gather(_mark_invalid(scores, valid))
    kept = ~scores.isnan()
    scores = _valid_only(scores, cfg)
    result: dict[str, float | None] = {"normalized_mean": scores.mean().item(),
                                       "normalized_std": scores.std(unbiased=False).item(),
                                       "fresh_samples": int(kept.sum()), "spearman": None}
    if labeler is not None:
        # The rater judges the (truncated) continuation only, as when labelling (the query is shared).
        texts = tokenizer.batch_decode(responses, skip_special_tokens=False)
        judged = dp.gather(torch.tensor(labeler.score(texts), dtype=torch.float32))
        result["spearman"] = spearman(scores, judged[kept])
    return result


def fit_reward_model(model, policy, tokenizer, train_examples: list, test_examples: list,
                     queries: list[list[int]], cfg: RMJobConfig, dp: DataParallel, labeler=None,
                     log: Log = print) -> dict:
    """Normalise, train one epoch, normalise again, check on a fresh sample. Returns metrics.

    ``dp.sharded``: the model is sharded with FSDP2 over the default process group here;
    otherwise it trains as a plain module in this process.
    """
    from rl_core.optim import build_optimizer, linear_anneal_schedule
    from workers.fsdp import TrainableModel, shard_model

    steps = len(train_examples) // cfg.train.batch_size
    if steps < 1:
        raise ValueError(f"the train set has {len(train_examples)} comparisons, fewer than one minibatch "
                         f"(train.batch_size={cfg.train.batch_size}); lower train.batch_size or add data")
    if dp.sharded:
        shard_model(model.to(dp.device), mixed_precision=cfg.model.mixed_precision)
    pad_id, max_tokens = tokenizer.pad_token_id, cfg.train.max_tokens_per_device
    trainable = TrainableModel(
        model,
        build_optimizer=lambda m: build_optimizer(m.parameters(), cfg.train.optimizer, cfg.train.lr,
                                                  eps=cfg.train.adam_eps),
        # OpenAI: one epoch, LR annealed linearly to zero.
        build_scheduler=lambda optimizer: linear_anneal_schedule(optimizer, steps),
        max_grad_norm=cfg.train.max_grad_norm,
        sharded=dp.sharded,
    )
    # OpenAI: normalise before training too, so the loss sees rewards at unit scale from step one.
    gain_before, _ = normalize_reward(model, policy, tokenizer, queries, cfg.normalize, cfg.seed, dp)
    before = heldout_metrics(model, test_examples, dp, max_tokens, pad_id)
    log(f"[train_rm] {len(train_examples)} train / {len(test_examples)} held-out comparisons, {steps} steps "
        f"on {dp.size} rank(s); held-out accuracy before training {before['accuracy']:.3f}")
    stats = train_one_epoch(trainable, train_examples, cfg.train, dp, pad_id, cfg.seed, log)
    after = heldout_metrics(model, test_examples, dp, max_tokens, pad_id)
    gain, bias = normalize_reward(model, policy, tokenizer, queries, cfg.normalize, cfg.seed + 1, dp)
    check = fresh_sample_check(model, policy, tokenizer, queries, cfg.normalize, cfg.seed + 2, dp, labeler)
    return {"heldout_accuracy": after["accuracy"], "heldout_loss": after["loss"],
            "heldout_accuracy_before": before["accuracy"], **stats, "gain_before": gain_before,
            "gain": gain, "bias": bias, **check}


def export_reward_model(model, tokenizer, out_dir: str | Path, dp: DataParallel) -> None:
    """Hugging Face seq-cls checkpoint + tokenizer on rank 0; gain/bias ride in the config."""
    from transformers import AutoModelForSequenceClassification

    from workers.fsdp import full_state_dict

    state = full_state_dict(model) if dp.sharded else None  # collective: every rank gathers
    if dp.rank != 0:
        return
    if state is not None:
        plain = AutoModelForSequenceClassification.from_config(copy.deepcopy(model.config))
        plain.load_state_dict(state)
        model = plain
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))


# ----------------------------------------------------------------------------- preference data


def load_preference_splits(cfg: RMDataConfig, train_path: str, test_path: str | None, tokenizer,
                           seed: int) -> tuple[list, list]:
    """Tokenized train and held-out comparisons; without a test file, a seeded split of train."""
    from rl_core.rm_data import load_preference_dataset, tokenize_preferences

    def load(path: str) -> list:
        examples, _ = load_preference_dataset(path, cfg.format, cfg.margin_map, cfg.on_malformed)
        return tokenize_preferences(examples, tokenizer, cfg.max_length)

    train = load(train_path)
    if test_path is not None:
        return train, load(test_path)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed)).tolist()
    n_test = max(1, round(len(train) * cfg.heldout_fraction))
    if n_test >= len(train):
        raise ValueError(f"{train_path} has {len(train)} comparisons, too few to hold out "
                         f"data.heldout_fraction={cfg.heldout_fraction}; give data.test_path")
    return [train[i] for i in order[n_test:]], [train[i] for i in order[:n_test]]


@dataclass(frozen=True)
class TinyRMSettings:
    """Everything that determines the offline labels and the tiny reward model built from them."""

    seed: int = 4321
    # Samples are drawn, then kept only if they have a period at or after token `truncate_after`
    # and cut there: OpenAI's rejection sampling, so raters (and the reward model) see what the
    # PPO job's reward model will score. About half of the tiny policy's samples qualify.
    train_samples_per_query: int = 8
    group_size: int = 4  # kept samples per train prompt; every pair among them is labelled
    test_samples_per_query: int = 12  # kept ones are paired off, so held-out pairs are independent
    query_length: int = 64
    response_length: int = 24
    truncate_token: Optional[str] = "."  # None: keep whole samples
    truncate_after: int = 16
    temperature: float = 1.0
    noise: float = 0.0
    batch_size: int = 32
    lr: float = 1e-3
    num_samples: int = 512  # normalisation / fresh-sample size


# Small (test) assets have a 64-token context, few prompts and a barely trained policy whose
# samples seldom hold a period or a sentiment word (most pairs tie): a build of a few seconds.
SMALL_RM_SETTINGS = TinyRMSettings(train_samples_per_query=4, group_size=4, test_samples_per_query=8,
                                   query_length=32, response_length=16, truncate_token=None, batch_size=8,
                                   num_samples=32)


def _preference_files(paths, task: str) -> tuple[Path, Path, Path]:
    directory = paths.root / "preferences"
    return (directory / f"{task}_train.jsonl", directory / f"{task}_test.jsonl",
            directory / f"{task}_build.json")


def _preference_settings(paths, task: str, settings: TinyRMSettings) -> dict:
    from rl_core.assets import read_build_facts

    return {"format": RM_BUILD_FORMAT, "task": task, "policy": read_build_facts(paths).get("settings"),
            **{k: v for k, v in dataclasses.asdict(settings).items()
               if k not in ("batch_size", "lr", "num_samples")}}


def _write_pairs(path: Path, queries: list[str], pairs: list[tuple[int, str, str]], labeler) -> dict[str, int]:
    """Pairwise rows, labelled one by one; pairs the rater scores equal are left out (a tie says nothing)."""
    counts = {"written": 0, "ties": 0}
    with open(path, "w", encoding="utf-8") as handle:
        for query_index, first, second in pairs:
            if not first.strip() or not second.strip():
                continue  # a rater cannot judge an empty continuation
            scores = labeler.score([first, second])
            if scores[0] == scores[1]:
                counts["ties"] += 1
                continue
            chosen, rejected = (first, second) if labeler.choose(scores) == 0 else (second, first)
            handle.write(json.dumps({"prompt": queries[query_index], "chosen": chosen, "rejected": rejected},
                                    ensure_ascii=False) + "\n")
            counts["written"] += 1
    return counts


def _labelled_pairs(queries: list[list[int]], responses: list[list[int]], draws: int, settings: TinyRMSettings,
                    truncate_id: int | None, every_pair: bool) -> list[tuple[int, list[int], list[int]]]:
    """(query index, response, response) pairs among each query's kept (period-truncated) samples.

    ``every_pair``: all pairs among ``group_size`` kept samples (InstructGPT's K-choose-2: more
    comparisons per sampled token); otherwise kept samples are paired off, each used once.
    """
    from rl_core.algorithms import truncated_ids

    pairs = []
    for index in range(len(queries)):
        drawn = responses[index * draws:(index + 1) * draws]
        if truncate_id is None:
            kept = drawn
        else:
            cuts = (truncated_ids(response, truncate_id, settings.truncate_after) for response in drawn)
            kept = [cut for cut in cuts if cut is not None]
        if every_pair:
            pairs.extend((index, a, b) for a, b in itertools.combinations(kept[:settings.group_size], 2))
        else:
            pairs.extend((index, a, b) for a, b in zip(kept[0::2], kept[1::2]))
    return pairs


def _build_preferences(paths, task: str, settings: TinyRMSettings) -> dict:
    """Sample from the tiny policy, keep and cut samples at a period, label pairs, write jsonl + marker."""
    from rl_core.labeler import get_labeler
    from workers.models import load_causal_lm, load_tokenizer, single_token_id

    train_file, test_file, marker = _preference_files(paths, task)
    tokenizer = load_tokenizer(str(paths.model_dir))
    policy = load_causal_lm(str(paths.model_dir), vocab_size=len(tokenizer)).eval()
    truncate_id = (None if settings.truncate_token is None
                   else single_token_id(tokenizer, settings.truncate_token, "truncate_token"))
    labeler = get_labeler(task, noise=settings.noise, seed=settings.seed)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    counts = {}
    splits = (("train", paths.train_prompts, settings.train_samples_per_query, train_file),
              ("test", paths.test_prompts, settings.test_samples_per_query, test_file))
    for offset, (split, prompts, draws, out) in enumerate(splits):
        queries = load_queries(prompts, "text", tokenizer, settings.query_length)
        repeated = [query for query in queries for _ in range(draws)]
        responses = sample_responses(policy, tokenizer, repeated, settings.response_length, settings.temperature,
                                     seed=settings.seed + offset, batch_size=256)
        pairs = _labelled_pairs(queries, responses, draws, settings, truncate_id, every_pair=split == "train")
        texts = [(index, tokenizer.decode(a), tokenizer.decode(b)) for index, a, b in pairs]
        staging = out.with_name(f".{out.name}.{os.getpid()}")
        written = _write_pairs(staging, tokenizer.batch_decode(queries), texts, labeler)
        os.replace(staging, out)
        counts[split], counts[f"{split}_ties_left_out"] = written["written"], written["ties"]
        if written["written"] == 0:
            raise RuntimeError(f"no {split} comparison could be labelled: the tiny policy's samples have no "
                               f"'{settings.truncate_token}' at or after token {settings.truncate_after}")
    marker.write_text(json.dumps({"settings": _preference_settings(paths, task, settings), **counts}, indent=2))
    return counts


def _is_small(paths) -> bool:
    try:
        return bool(json.loads(paths.summary_file.read_text()).get("small", False))
    except (OSError, json.JSONDecodeError):
        return False


def tiny_rm_settings(paths, small: bool | None = None) -> TinyRMSettings:
    """Small settings for small (test) assets, else the real ones."""
    return SMALL_RM_SETTINGS if (_is_small(paths) if small is None else small) else TinyRMSettings()


def ensure_tiny_preferences(paths, task: str = "sentiment", log: Log = print, small: bool | None = None,
                            noise: float | None = None) -> tuple[Path, Path]:
    """Offline preference files ``<root>/preferences/<task>_{train,test}.jsonl``, built if missing."""
    settings = tiny_rm_settings(paths, small)
    if noise is not None:
        settings = dataclasses.replace(settings, noise=noise)
    train_file, test_file, marker = _preference_files(paths, task)
    if not settings_match(marker, _preference_settings(paths, task, settings)):
        with file_lock(paths.root / f".{task}-rm.lock"):
            if not settings_match(marker, _preference_settings(paths, task, settings)):
                log(f"[rl_core.train_rm] labelling tiny {task} preferences under {marker.parent}; cached")
                _build_preferences(paths, task, settings)
    return train_file, test_file


def _rm_settings(paths, task: str, settings: TinyRMSettings) -> dict:
    return {"format": RM_BUILD_FORMAT, "component": f"{task}-reward-model",
            "policy": _preference_settings(paths, task, settings)["policy"], **dataclasses.asdict(settings)}


def tiny_rm_job_config(task: str, settings: TinyRMSettings) -> RMJobConfig:
    """The job config the bootstrap trains with: the CLI job's code path, fixed settings."""
    cfg = RMJobConfig(seed=settings.seed, labeler=LabelerConfig(name=task, noise=settings.noise))
    cfg.train.batch_size, cfg.train.lr = settings.batch_size, settings.lr
    cfg.normalize.num_samples = settings.num_samples
    cfg.normalize.query_length = settings.query_length
    cfg.normalize.response_length = settings.response_length
    cfg.normalize.temperature = settings.temperature
    cfg.normalize.truncate_token = settings.truncate_token
    cfg.normalize.truncate_after = settings.truncate_after
    return cfg


def _train_tiny_reward_model(paths, task: str, settings: TinyRMSettings, out_dir: Path) -> dict:
    """Single process, no torch.distributed: safe inside another job's process group."""
    from rl_core.labeler import get_labeler
    from workers.models import load_causal_lm, load_tokenizer

    cfg = tiny_rm_job_config(task, settings)
    train_file, test_file, marker = _preference_files(paths, task)
    if not settings_match(marker, _preference_settings(paths, task, settings)):
        _build_preferences(paths, task, settings)
    tokenizer = load_tokenizer(str(paths.model_dir))
    policy = load_causal_lm(str(paths.model_dir), vocab_size=len(tokenizer)).eval()
    cfg.data.max_length = min(cfg.data.max_length, context_length(policy) or cfg.data.max_length)
    check_lengths(cfg, context_length(policy))
    train, test = load_preference_splits(cfg.data, str(train_file), str(test_file), tokenizer, cfg.seed)
    queries = load_queries(paths.train_prompts, "text", tokenizer, settings.query_length)
    model = build_reward_model(str(paths.model_dir), tokenizer, cfg.seed)
    quiet: Log = lambda *_: None  # noqa: E731 - the bootstrap logs one line only
    metrics = fit_reward_model(model, policy, tokenizer, train, test, queries, cfg, DataParallel(),
                               get_labeler(task), quiet)
    export_reward_model(model, tokenizer, out_dir, DataParallel())
    return metrics


@contextlib.contextmanager
def _quiet_libraries() -> Iterator[None]:
    """Hide Hugging Face progress bars and load reports: the bootstrap promises one log line."""
    import datasets
    from transformers.utils import logging as hf_logging

    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    dataset_bars = datasets.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
        if dataset_bars:
            datasets.enable_progress_bars()


def ensure_tiny_reward_model(paths, log: Log = print, task: str = "sentiment", small: bool | None = None) -> Path:
    """The tiny reward model ``<root>/tiny-<task>-rm/`` for the PPO job, built if missing.

    Offline labels come from the task's labeler judging pairs of tiny-policy samples; the model
    is trained by the same code as the CLI job, in this process without torch.distributed (the
    PPO job calls this on rank 0 alone). Idempotent and locked, so concurrent callers build once.
    ``small``: None = follow the assets (small test assets get a quick build).
    """
    settings = tiny_rm_settings(paths, small)
    final = paths.root / f"tiny-{task}-rm"
    expected = _rm_settings(paths, task, settings)
    if settings_match(final / "build.json", expected):
        return final
    with file_lock(paths.root / f".{task}-rm.lock"):
        if settings_match(final / "build.json", expected):
            return final
        log(f"[rl_core.train_rm] building the tiny {task} reward model under {final} from offline labels; "
            f"cached for later runs")
        started = time.perf_counter()
        # One thread: the model is too small to gain from more, and on a shared CPU (ranks,
        # engines) extra threads oversubscribe the cores and run several times slower.
        with staged_directory(final) as staging, torch_threads(1), _quiet_libraries():
            metrics = _train_tiny_reward_model(paths, task, settings, staging)
            facts = {"settings": expected, "seconds": round(time.perf_counter() - started, 1), **metrics}
            (staging / "build.json").write_text(json.dumps(facts, indent=2))  # the marker, written last
    return final


# ----------------------------------------------------------------------------- the job


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def default_to_single_process() -> None:
    """``python -m rl_core.train_rm`` without torchrun: a world of one on this host."""
    if "RANK" in os.environ:
        return
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(_free_port()))


def _ensure_tiny_inputs(cfg: RMJobConfig, log: Log):
    from rl_core.assets import ensure_tiny_assets

    paths = ensure_tiny_assets(log=log)
    if cfg.data.train_path == "tiny":
        ensure_tiny_preferences(paths, cfg.labeler.name, log, noise=cfg.labeler.noise)
    return paths


def _resolve_inputs(cfg: RMJobConfig, dp: DataParallel, log: Log) -> dict[str, str | None]:
    """Paths of policy, preference files and prompts; tiny assets are built (rank 0 first)."""
    uses_tiny = "tiny" in (cfg.model.policy_path, cfg.data.train_path, cfg.normalize.prompts_path)
    paths = None
    if uses_tiny:
        if dp.rank == 0:  # rank 0 builds what is missing (and logs) while the others wait
            paths = _ensure_tiny_inputs(cfg, log)
        dp.barrier()
        if dp.rank != 0:
            paths = _ensure_tiny_inputs(cfg, lambda *_: None)
    policy = str(paths.model_dir) if cfg.model.policy_path == "tiny" else cfg.model.policy_path
    train, test = cfg.data.train_path, cfg.data.test_path
    if train == "tiny":
        tiny_train, tiny_test = _preference_files(paths, cfg.labeler.name)[:2]
        train, test = str(tiny_train), (str(tiny_test) if test == "tiny" else test)
    prompts = str(paths.train_prompts) if cfg.normalize.prompts_path == "tiny" else cfg.normalize.prompts_path
    return {"policy": policy, "train": train, "test": test, "prompts": prompts,
            "init_from": cfg.model.init_from or policy}


def run_job(cfg: RMJobConfig, dp: DataParallel, log: Log = print) -> dict:
    """The whole job on this rank; returns the metrics (identical on every rank)."""
    from rl_core.labeler import get_labeler
    from workers.models import load_causal_lm, load_tokenizer

    started = time.perf_counter()
    inputs = _resolve_inputs(cfg, dp, log)
    tokenizer = load_tokenizer(inputs["policy"])
    policy = load_causal_lm(inputs["policy"], vocab_size=len(tokenizer)).to(dp.device).eval()
    check_lengths(cfg, context_length(policy))
    train, test = load_preference_splits(cfg.data, inputs["train"], inputs["test"], tokenizer, cfg.seed)
    queries = load_queries(inputs["prompts"], cfg.normalize.text_key, tokenizer, cfg.normalize.query_length)
    labeler = get_labeler(cfg.labeler.name) if cfg.labeler.name else None
    model = build_reward_model(inputs["init_from"], tokenizer, cfg.seed)
    metrics = fit_reward_model(model, policy, tokenizer, train, test, queries, cfg, dp, labeler, log)
    output_dir = Path(cfg.output_dir or Path(cfg.run_dir) / "reward_model")
    export_reward_model(model, tokenizer, output_dir, dp)
    metrics.update(output_dir=str(output_dir.resolve()), world_size=dp.size,
                   seconds=round(time.perf_counter() - started, 1))
    if dp.rank == 0:
        save_config(cfg, Path(cfg.run_dir) / "config.yaml")
        (Path(cfg.run_dir) / "metrics.json").write_text(json.dumps(metrics, indent=2))
    return metrics


def main(argv: list[str] | None = None) -> None:
    from rl_core.cli import parse_job_config
    from workers.fsdp import device_for_rank, init_distributed, seed_everything

    cfg = parse_job_config(argv, __doc__, "rm_sentiment.yaml", schema=RMJobConfig, validate=validate_rm_config)
    default_to_single_process()
    rank, world_size = init_distributed(timeout_s=cfg.train.collective_timeout_s)
    try:
        seed_everything(cfg.seed)  # same init everywhere; sampling seeds are per rank (rank_seed)
        dp = DataParallel(rank, world_size, sharded=True, device=device_for_rank())

        def log(line: str) -> None:
            if rank == 0:
                print(line, flush=True)

        metrics = run_job(cfg, dp, log)
        dp.barrier()
        if rank == 0:
            print(json.dumps(metrics), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
