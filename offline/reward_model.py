"""The tiny sentiment reward model the offline recipes use: labels, then the reward-model job's training.

Offline labels stand in for human raters: the tiny policy samples continuations of prompts, the
samples are cut at the first period at or after token 16 (OpenAI's rejection sampling, so the
rater sees what the PPO job's reward model will score), and the task's lexicon labeler judges
pairs of them; ties are left out. The reward model is then trained by the same code as
`python -m rl_core.train_rm`, in this process without torch.distributed (the PPO job calls this
on rank 0 alone). Every build is cached, locked and written atomically (offline/assets.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from rl_core.logger import progress_bar
from rl_core.rewards.lm_human_preferences import truncated_ids
from rl_core.reward_model.config import LabelerConfig, RMConfig, check_lengths
from rl_core.reward_model.sampling import load_queries, sample_responses
from rl_core.distributed import DataParallel
from rl_core.reward_model.training import (Log, ReferenceSamples, Reporting, build_reward_model,
                                           export_reward_model, fit_reward_model)
from rl_core.preferences import load_preference_splits
from offline.assets import file_lock, read_build_facts, settings_match, staged_directory, torch_threads
from offline.labeler import get_labeler
from workers.loading import context_length, load_causal_lm, load_tokenizer, single_token_id

RM_BUILD_FORMAT = 2


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


def preference_files(paths, task: str) -> tuple[Path, Path, Path]:
    directory = paths.root / "preferences"
    return (directory / f"{task}_train.jsonl", directory / f"{task}_test.jsonl",
            directory / f"{task}_build.json")


def _preference_settings(paths, task: str, settings: TinyRMSettings) -> dict:

    return {"format": RM_BUILD_FORMAT, "task": task, "policy": read_build_facts(paths).get("settings"),
            **{k: v for k, v in dataclasses.asdict(settings).items()
               if k not in ("batch_size", "lr", "num_samples")}}


def _write_pairs(path: Path, queries: list[str], pairs: list[tuple[int, str, str]], labeler,
                 desc: str | None = None) -> dict[str, int]:
    """Pairwise rows, labelled one by one; pairs the rater scores equal are left out (a tie says nothing)."""
    counts = {"written": 0, "ties": 0, "empty": 0}
    with open(path, "w", encoding="utf-8") as handle:
        for query_index, first, second in progress_bar(pairs, desc=desc or "", enabled=desc is not None, unit="pair"):
            if not first.strip() or not second.strip():
                counts["empty"] += 1  # a rater cannot judge an empty continuation
                continue
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


def _build_preferences(paths, task: str, settings: TinyRMSettings, progress: bool = False) -> dict:
    """Sample from the tiny policy, keep and cut samples at a period, label pairs, write jsonl + marker. On one
    thread, as the reward model's build: the same samples whatever the machine's load."""
    with torch_threads(1):
        return _sample_and_label(paths, task, settings, progress)


def _sample_and_label(paths, task: str, settings: TinyRMSettings, progress: bool) -> dict:
    train_file, test_file, marker = preference_files(paths, task)
    tokenizer = load_tokenizer(str(paths.model_dir))
    policy = load_causal_lm(str(paths.model_dir)).eval()
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
                                     seed=settings.seed + offset, batch_size=256,
                                     desc=f"[offline] sampling {split} continuations" if progress else None)
        pairs = _labelled_pairs(queries, responses, draws, settings, truncate_id, every_pair=split == "train")
        texts = [(index, tokenizer.decode(a), tokenizer.decode(b)) for index, a, b in pairs]
        staging = out.with_name(f".{out.name}.{os.getpid()}")
        written = _write_pairs(staging, tokenizer.batch_decode(queries), texts, labeler,
                               f"[offline] labelling {split} pairs" if progress else None)
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
                            noise: float | None = None, progress: bool = True) -> tuple[Path, Path]:
    """Offline preference files ``<root>/preferences/<task>_{train,test}.jsonl``, built if missing."""
    settings = tiny_rm_settings(paths, small)
    if noise is not None:
        settings = dataclasses.replace(settings, noise=noise)
    train_file, test_file, marker = preference_files(paths, task)
    if not settings_match(marker, _preference_settings(paths, task, settings)):
        with file_lock(paths.root / f".{task}-rm.lock"):
            if not settings_match(marker, _preference_settings(paths, task, settings)):
                log(f"[offline] labelling tiny {task} preferences under {marker.parent}; cached")
                _build_preferences(paths, task, settings, progress)
    return train_file, test_file


def _rm_settings(paths, task: str, settings: TinyRMSettings) -> dict:
    return {"format": RM_BUILD_FORMAT, "component": f"{task}-reward-model",
            "policy": _preference_settings(paths, task, settings)["policy"], **dataclasses.asdict(settings)}


def tiny_rm_job_config(task: str, settings: TinyRMSettings) -> RMConfig:
    """The job config the bootstrap trains with: the CLI job's code path, fixed settings."""
    cfg = RMConfig(labeler=LabelerConfig(name=task, noise=settings.noise))
    cfg.trainer.seed = settings.seed
    cfg.train.batch_size, cfg.train.lr = settings.batch_size, settings.lr
    cfg.normalize.num_samples = settings.num_samples
    cfg.normalize.query_length = settings.query_length
    cfg.normalize.response_length = settings.response_length
    cfg.normalize.temperature = settings.temperature
    cfg.normalize.truncate_token = settings.truncate_token
    cfg.normalize.truncate_after = settings.truncate_after
    return cfg


def _train_tiny_reward_model(paths, task: str, settings: TinyRMSettings, out_dir: Path, progress: bool) -> dict:
    """Single process, no torch.distributed: safe inside another job's process group."""

    cfg = tiny_rm_job_config(task, settings)
    cfg.trainer.progress = progress
    train_file, test_file, marker = preference_files(paths, task)
    if not settings_match(marker, _preference_settings(paths, task, settings)):
        _build_preferences(paths, task, settings, progress)
    tokenizer = load_tokenizer(str(paths.model_dir))
    policy = load_causal_lm(str(paths.model_dir)).eval()
    cfg.data.max_length = min(cfg.data.max_length, context_length(policy.config) or cfg.data.max_length)
    check_lengths(cfg, context_length(policy.config))
    train, test = load_preference_splits(cfg.data, str(train_file), str(test_file), tokenizer, cfg.trainer.seed)
    queries = load_queries(paths.train_prompts, "text", tokenizer, settings.query_length)
    model = build_reward_model(str(paths.model_dir), tokenizer, cfg.trainer.seed)
    quiet: Log = lambda *_: None  # noqa: E731 - the bootstrap logs one line, and its progress bars
    reference = ReferenceSamples(policy, tokenizer, queries, cfg.normalize, DataParallel())
    metrics = fit_reward_model(model, reference, train, test, cfg, get_labeler(task), Reporting(quiet))
    export_reward_model(model, tokenizer, out_dir, DataParallel())
    return metrics


@contextlib.contextmanager
def _quiet_libraries() -> Iterator[None]:
    """Hide Hugging Face progress bars and load reports: the bootstrap shows one log line and its own bars."""
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


def ensure_tiny_reward_model(paths, log: Log = print, task: str = "sentiment", small: bool | None = None,
                             progress: bool = True) -> Path:
    """The tiny reward model ``<root>/tiny-<task>-rm/`` for the PPO job, built if missing.

    Offline labels come from the task's labeler judging pairs of tiny-policy samples; the model
    is trained by the same code as the CLI job, in this process without torch.distributed (the
    PPO job calls this on rank 0 alone). Idempotent and locked, so concurrent callers build once.
    ``small``: None = follow the assets (small test assets get a quick build). ``progress``: bars
    with ETAs for sampling, labelling, training and normalisation (minutes on a CPU).
    """
    settings = tiny_rm_settings(paths, small)
    final = paths.root / f"tiny-{task}-rm"
    expected = _rm_settings(paths, task, settings)
    if settings_match(final / "build.json", expected):
        return final
    with file_lock(paths.root / f".{task}-rm.lock"):
        if settings_match(final / "build.json", expected):
            return final
        log(f"[offline] building the tiny {task} reward model under {final} from offline labels; "
            f"cached for later runs")
        started = time.perf_counter()
        # One thread: the model is too small to gain from more, and on a shared CPU (ranks,
        # engines) extra threads oversubscribe the cores and run several times slower.
        with staged_directory(final) as staging, torch_threads(1), _quiet_libraries():
            metrics = _train_tiny_reward_model(paths, task, settings, staging, progress)
            facts = {"settings": expected, "seconds": round(time.perf_counter() - started, 1), **metrics}
            (staging / "build.json").write_text(json.dumps(facts, indent=2))  # the marker, written last
    return final
