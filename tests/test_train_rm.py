"""Reward-model job: 2-rank FSDP run end to end, its checkpoint, normalisation, config errors, bootstrap."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
OPENINGS = ["the old man walked to the market", "she looked at the garden", "the children went to the river",
            "he opened the door", "the teacher sat by the window", "we walked home in the rain"]
POSITIVE = ["and felt happy and proud.", "and smiled at the wonderful sun.", "and laughed with joy.",
            "and loved the lovely morning."]
NEGATIVE = ["and felt sad and angry.", "and cried in the terrible storm.", "and was hurt and lonely.",
            "and hated the awful cold."]


def _write_pairs(path: Path, pairs: list[tuple[str, str, str]]) -> None:
    """Pairwise rows labelled by the sentiment labeler (which of the two it prefers)."""
    from rl_core.labeler import SentimentLabeler

    labeler = SentimentLabeler()
    with path.open("w") as handle:
        for prompt, first, second in pairs:
            best = labeler.label_pair(prompt, [first, second])
            chosen, rejected = (first, second) if best == 0 else (second, first)
            handle.write(json.dumps({"prompt": prompt, "chosen": " " + chosen, "rejected": " " + rejected}) + "\n")


def _pairs(seed: int, count: int) -> list[tuple[str, str, str]]:
    rng = torch.Generator().manual_seed(seed)
    pick = lambda options: options[int(torch.randint(len(options), (1,), generator=rng))]  # noqa: E731
    pairs = []
    for _ in range(count):
        good, bad = pick(POSITIVE), pick(NEGATIVE)
        pairs.append((pick(OPENINGS), *((good, bad) if torch.rand(1, generator=rng) < 0.5 else (bad, good))))
    return pairs


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    env.pop("RANK", None)
    return env


@pytest.fixture(scope="module")
def rm_run(tiny_model_dir, tmp_path_factory):
    """One 2-process torchrun of the job on tiny data; returns (metrics, stdout, tmp dir)."""
    tmp = tmp_path_factory.mktemp("rm_job")
    _write_pairs(tmp / "train.jsonl", _pairs(0, 96))
    _write_pairs(tmp / "test.jsonl", _pairs(1, 32))
    (tmp / "prompts.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in OPENINGS))
    overrides = [
        f"model.policy_path={tiny_model_dir}", f"data.train_path={tmp / 'train.jsonl'}",
        f"data.test_path={tmp / 'test.jsonl'}", "data.max_length=48", f"normalize.prompts_path={tmp / 'prompts.jsonl'}",
        "normalize.query_length=12", "normalize.response_length=8", "normalize.num_samples=256",
        "normalize.truncate_token=null",
        "train.batch_size=16", "train.lr=3e-3", "train.max_tokens_per_device=256", f"run_dir={tmp / 'run'}",
    ]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "rl_core.train_rm", "--config", "rm_sentiment.yaml", *overrides]
    proc = subprocess.run(cmd, cwd=tmp, env=_env(), capture_output=True, text=True, timeout=150,
                          start_new_session=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = [line for line in proc.stdout.splitlines() if line.strip()][-1]
    return json.loads(last), proc.stdout, tmp


@pytest.mark.timeout(200)
def test_two_rank_job_reports_and_learns(rm_run):
    metrics, stdout, _ = rm_run
    for key in ("heldout_accuracy", "spearman", "gain", "bias", "normalized_mean", "normalized_std", "output_dir"):
        assert key in metrics, key
    assert 0.0 <= metrics["heldout_accuracy"] <= 1.0
    assert metrics["world_size"] == 2
    assert metrics["train_steps"] == 96 // 16
    # The sentiment words are easy to separate: the model must beat chance clearly.
    assert metrics["heldout_accuracy"] >= 0.75, stdout
    assert abs(metrics["normalized_mean"]) < 0.25 and 0.75 < metrics["normalized_std"] < 1.25
    assert sum(line.startswith("{") for line in stdout.splitlines()) == 1, "only rank 0 prints the result"


@pytest.mark.timeout(200)
def test_checkpoint_loads_and_is_normalised_on_fresh_samples(rm_run, tiny_model_dir):
    from transformers import AutoModelForSequenceClassification

    from rl_core.train_rm import load_queries, sample_responses, score_sequences
    from workers.models import load_causal_lm, load_reward_model, load_tokenizer

    metrics, _, tmp = rm_run
    out = Path(metrics["output_dir"])
    assert AutoModelForSequenceClassification.from_pretrained(out).config.num_labels == 1
    tokenizer = load_tokenizer(str(out))
    model = load_reward_model(str(out), pad_token_id=tokenizer.pad_token_id)
    assert model.config.reward_gain == pytest.approx(metrics["gain"])
    assert model.config.reward_bias == pytest.approx(metrics["bias"])

    policy = load_causal_lm(tiny_model_dir, vocab_size=len(tokenizer)).eval()
    queries = load_queries(tmp / "prompts.jsonl", "text", tokenizer, 12) * 40
    responses = sample_responses(policy, tokenizer, queries, 8, 1.0, seed=987)
    assert {len(r) for r in responses} == {8}, "fixed-length samples: EOS must not stop them"
    scores = score_sequences(model, [q + r for q, r in zip(queries, responses)], tokenizer.pad_token_id,
                             torch.device("cpu"), normalized=True)
    assert abs(scores.mean().item()) < 0.25
    assert 0.75 < scores.std(unbiased=False).item() < 1.25


def test_bad_config_key_exits_2_with_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "rl_core.train_rm", "--config", "rm_sentiment.yaml",
                           "train.batch_sise=4"], cwd=tmp_path, env=_env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "train.batch_sise" in lines[0] and "train.batch_size" in lines[0], proc.stderr


def test_validation_names_the_key_and_fix():
    from rl_core.config import ConfigError, load_config
    from rl_core.train_rm import RMJobConfig, validate_rm_config

    def load(*overrides):
        return load_config("rm_sentiment.yaml", list(overrides), schema=RMJobConfig, validate=validate_rm_config)

    assert load().train.batch_size > 0
    with pytest.raises(ConfigError, match="labeler.name"):
        load("labeler.name=null")
    with pytest.raises(ConfigError, match="train.max_tokens_per_device"):
        load("data.max_length=128", "train.max_tokens_per_device=200")
    with pytest.raises(ConfigError, match="data.test_path"):
        load("data.train_path=/some/file.jsonl")


def test_micro_batches_keep_comparisons_whole_and_ranks_even():
    from rl_core.rm_data import TokenizedPreference
    from rl_core.train_rm import DataParallel, micro_batches_for_rank

    examples = [TokenizedPreference([[5] * (3 + i % 7), [6] * (2 + i % 5)], 1, i % 2, 0.0) for i in range(13)]
    per_rank = [micro_batches_for_rank(examples, DataParallel(rank, 2), 40, pad_id=0) for rank in (0, 1)]
    assert len(per_rank[0]) == len(per_rank[1]), "every rank runs the same number of passes"
    rows = sum(int(batch["weight"]) * batch["input_ids"].shape[0] for batches in per_rank for batch in batches)
    best = sorted(b for batches in per_rank for batch in batches if batch["weight"] for b in batch["best"].tolist())
    assert rows == 2 * len(examples), "each example's two responses land in one micro-batch, once"
    assert best == sorted(e.best for e in examples)
    assert all(int(batch["attention_mask"].sum(1).max()) <= 40 for batches in per_rank for batch in batches)


@pytest.mark.timeout(200)
def test_tiny_reward_model_is_built_once_and_cached(tmp_path):
    from rl_core.assets import ensure_tiny_assets
    from rl_core.train_rm import ensure_tiny_reward_model
    from workers.models import load_reward_model

    paths = ensure_tiny_assets(tmp_path, small=True, log=lambda *_: None)
    logged: list[str] = []
    first = ensure_tiny_reward_model(paths, log=logged.append)
    assert len(logged) == 1 and "reward model" in logged[0]
    facts = json.loads((first / "build.json").read_text())
    assert 0.0 <= facts["heldout_accuracy"] <= 1.0
    assert (paths.root / "preferences" / "sentiment_train.jsonl").stat().st_size > 0
    model = load_reward_model(str(first))
    assert model.config.num_labels == 1 and model.config.reward_gain != 1.0
    stamp = (first / "build.json").stat().st_mtime_ns
    assert ensure_tiny_reward_model(paths, log=logged.append) == first
    assert len(logged) == 1 and (first / "build.json").stat().st_mtime_ns == stamp


def test_labelled_pairs_keep_samples_with_a_period_and_cut_there():
    from rl_core.train_rm import TinyRMSettings, _labelled_pairs

    dot = 9
    settings = TinyRMSettings(group_size=3, truncate_after=2)
    responses = [
        [5, 6, 7, dot, 8], [5, dot, 6, 7, 8], [4, 4, dot, 3, dot], [3, 3, 3, dot, 1],  # query 0: 3 kept
        [5, 5, dot, 1, 1], [6, 6, 6, 6, 6], [7, 7, 7, dot, 7], [8, 8, 8, 8, dot],  # query 1: 3 kept
    ]
    every = _labelled_pairs([[1], [2]], responses, 4, settings, dot, every_pair=True)
    assert [index for index, _, _ in every] == [0, 0, 0, 1, 1, 1], "all 3 pairs among 3 kept samples"
    assert (0, [5, 6, 7, dot], [4, 4, dot]) in every, "cut through the first period at/after index 2"
    disjoint = _labelled_pairs([[1], [2]], responses, 4, settings, dot, every_pair=False)
    assert disjoint == [(0, [5, 6, 7, dot], [4, 4, dot]), (1, [5, 5, dot], [7, 7, 7, dot])]


def test_written_pairs_leave_out_ties_and_follow_the_labeler(tmp_path):
    from rl_core.labeler import get_labeler
    from rl_core.train_rm import _write_pairs as write_labelled

    pairs = [(0, " He was very sad and hurt.", " He was so happy and proud."),
             (0, " He sat down.", " He walked on."),  # both neutral: a tie, left out
             (1, " What a wonderful day.", " What a terrible day.")]
    counts = write_labelled(tmp_path / "p.jsonl", ["q0", "q1"], pairs, get_labeler("sentiment"))
    assert counts == {"written": 2, "ties": 1}
    rows = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert [(r["prompt"], r["chosen"]) for r in rows] == [("q0", " He was so happy and proud."),
                                                           ("q1", " What a wonderful day.")]


def test_normalisation_samples_are_cut_at_the_truncate_token_or_left_out(tiny_model_dir):
    from collections import Counter

    from rl_core.train_rm import NormalizeConfig, _mark_invalid, _valid_only, sample_responses, sample_truncated
    from workers.models import load_causal_lm, load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    policy = load_causal_lm(tiny_model_dir, vocab_size=len(tokenizer)).eval()
    queries = [tokenizer.encode("Tom was happy.")] * 24
    plain = sample_responses(policy, tokenizer, queries, 12, 1.0, seed=3)
    # The random test model has no favourite '.', so truncate at the token it samples most.
    counts = Counter(token for response in plain for token in response[1:])
    token = next(t for t, _ in counts.most_common()
                 if tokenizer.encode(tokenizer.decode([t]), add_special_tokens=False) == [t])
    cfg = NormalizeConfig(response_length=12, truncate_after=1, truncate_token=tokenizer.decode([token]))
    responses, valid = sample_truncated(policy, tokenizer, queries, cfg, seed=3)
    assert valid.any()
    for response, full, ok in zip(responses, plain, valid.tolist()):
        if ok:
            assert response == full[:len(response)] and response[-1] == token and token not in response[1:-1]
        else:
            assert response == full and token not in full[1:]
    scores = _mark_invalid(torch.arange(24.0), valid)
    assert torch.equal(_valid_only(scores, cfg), torch.arange(24.0)[valid])
    with pytest.raises(ValueError, match="normalize.truncate_token"):
        _valid_only(torch.full((4,), float("nan")), cfg)
