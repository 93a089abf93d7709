"""Reward-model job: 2-rank FSDP run end to end, its checkpoint, normalisation, config errors, bootstrap."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.jobs import read_metrics, torchrun, undocumented_metrics

REPO = Path(__file__).resolve().parents[2]
OPENINGS = ["the old man walked to the market", "she looked at the garden", "the children went to the river",
            "he opened the door", "the teacher sat by the window", "we walked home in the rain"]
POSITIVE = ["and felt happy and proud.", "and smiled at the wonderful sun.", "and laughed with joy.",
            "and loved the lovely morning."]
NEGATIVE = ["and felt sad and angry.", "and cried in the terrible storm.", "and was hurt and lonely.",
            "and hated the awful cold."]


def _write_pairs(path: Path, pairs: list[tuple[str, str, str]]) -> None:
    """Pairwise rows labelled by the sentiment labeler (which of the two it prefers)."""
    from offline.labeler import SentimentLabeler

    labeler = SentimentLabeler()
    with path.open("w") as handle:
        for prompt, first, second in pairs:
            best = labeler.label_group(prompt, [first, second])
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


def run_rm(overrides: list[str], cwd: Path) -> tuple[dict, str]:
    """A 2-process torchrun of the job; its result line (the last printed) and stdout."""
    proc = subprocess.run(torchrun("rl_core.train_rm", "rm_sentiment.yaml", *overrides), cwd=cwd, env=_env(), capture_output=True, text=True, timeout=150,
                          start_new_session=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = [line for line in proc.stdout.splitlines() if line.strip()][-1]
    return json.loads(last), proc.stdout


@pytest.fixture(scope="module")
def rm_run(tiny_model_dir, tmp_path_factory):
    """One 2-process torchrun of the job on tiny data, a checkpoint every 2 of its 6 steps, step 3 profiled; returns
    (metrics, stdout, tmp dir, overrides)."""
    tmp = tmp_path_factory.mktemp("rm_job")
    _write_pairs(tmp / "train.jsonl", _pairs(0, 96))
    _write_pairs(tmp / "test.jsonl", _pairs(1, 32))
    (tmp / "prompts.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in OPENINGS))
    overrides = [
        f"model.policy_path={tiny_model_dir}", f"data.train_path={tmp / 'train.jsonl'}",
        f"data.test_path={tmp / 'test.jsonl'}", "data.max_length=48", f"normalize.prompts_path={tmp / 'prompts.jsonl'}",
        "normalize.query_length=12", "normalize.response_length=8", "normalize.num_samples=256",
        "normalize.truncate_token=null",
        "train.batch_size=16", "train.lr=3e-3", "train.max_tokens_per_device=256", "trainer.save_every=2",
        "trainer.keep_last=0",
    ]
    metrics, stdout = run_rm(overrides + [f"trainer.run_dir={tmp / 'run'}", "trainer.profile_steps=[3]"], tmp)
    return metrics, stdout, tmp, overrides



@pytest.mark.timeout(200)
def test_two_rank_job_reports_and_learns(rm_run):
    metrics, stdout, _, _ = rm_run
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
def test_the_shared_step_loop_logs_each_step_once_and_traces_the_listed_one(rm_run):
    """The job runs on every job's step loop (rl_core/step_loop.py): a metrics row per step, over both ranks, whose
    losses and hits add up to the epoch's; the listed step traced on each rank."""
    metrics, stdout, tmp, _ = rm_run
    rows = read_metrics(tmp / "run")
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6]
    assert sum(row["train/loss"] for row in rows) / 6 == pytest.approx(metrics["train_loss"], rel=1e-5)
    assert sum(row["train/accuracy"] for row in rows) / 6 == pytest.approx(metrics["train_accuracy"], rel=1e-5)
    assert all(row["train/grad_norm"] > 0 and row["perf/step_s"] > 0 for row in rows)
    assert rows[0]["train/lr"] > rows[-1]["train/lr"] > 0  # OpenAI: annealed linearly towards zero over the epoch
    assert undocumented_metrics(rows) == [], "add these to rl_core/metric_docs/"
    profile = tmp / "run" / "profile"
    assert sorted(p.relative_to(profile).as_posix() for p in profile.rglob("*.json")) == [
        "step_3/rank0.pt.trace.json", "step_3/rank1.pt.trace.json"]
    assert "profile of step 3" in stdout and (tmp / "run" / "tensorboard").is_dir()


@pytest.mark.timeout(200)
def test_a_run_resumed_mid_epoch_ends_as_the_uninterrupted_one(rm_run):
    """trainer.resume=auto from the step-2 checkpoint alone (as a run stopped at step 3 leaves it): the same
    remaining minibatches, optimizer, schedule and pre-training normalisation, so the same rows and results."""
    import shutil

    metrics, _, tmp, overrides = rm_run
    saved = sorted(path.name for path in (tmp / "run" / "checkpoints").iterdir())
    assert saved == ["step_00000002", "step_00000004", "step_00000006"], saved
    resumed_dir = tmp / "resumed"
    shutil.copytree(tmp / "run" / "checkpoints" / "step_00000002", resumed_dir / "checkpoints" / "step_00000002")
    resumed, resumed_stdout = run_rm(overrides + [f"trainer.run_dir={resumed_dir}", "trainer.resume=auto"], tmp)
    assert f"resumed from {resumed_dir / 'checkpoints' / 'step_00000002'} at step 2" in resumed_stdout
    rows, resumed_rows = read_metrics(tmp / "run"), read_metrics(resumed_dir)
    assert [row["step"] for row in resumed_rows] == [3, 4, 5, 6]
    for row, again in zip(rows[2:], resumed_rows):
        assert again["train/loss"] == pytest.approx(row["train/loss"], rel=1e-5, abs=1e-6)
    for key in ("train_loss", "train_accuracy", "heldout_accuracy", "heldout_loss", "heldout_accuracy_before",
                "gain_before", "gain", "bias", "normalized_mean", "normalized_std", "spearman"):
        assert resumed[key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-6), key


@pytest.mark.timeout(200)
def test_a_finished_run_resumed_loads_nothing_and_ends_with_its_results(rm_run):
    """trainer.resume=auto on a run whose checkpoint is at the last step and whose model is exported: the one
    "nothing left to train" line every job ends with, before any model loads or any sampling, and the results
    it ended with as the last line again (the export untouched)."""
    metrics, _, tmp, overrides = rm_run
    export = Path(metrics["output_dir"]) / "model.safetensors"
    written = export.stat().st_mtime_ns
    again, stdout = run_rm(overrides + [f"trainer.run_dir={tmp / 'run'}", "trainer.resume=auto"], tmp)
    assert f"nothing left to train: {tmp / 'run' / 'checkpoints' / 'step_00000006'} is at step 6" in stdout
    assert "sampling" not in stdout and "normalis" not in stdout
    assert again == metrics and export.stat().st_mtime_ns == written


@pytest.mark.timeout(200)
def test_checkpoint_loads_and_is_normalised_on_fresh_samples(rm_run, tiny_model_dir):
    from transformers import AutoModelForSequenceClassification

    from rl_core.reward_model.sampling import load_queries, sample_responses
    from rl_core.reward_model.training import score_sequences
    from workers.loading import load_causal_lm, load_reward_model, load_tokenizer
    from workers.worker import BatchWorker

    metrics, _, tmp, _ = rm_run
    out = Path(metrics["output_dir"])
    assert AutoModelForSequenceClassification.from_pretrained(out).config.num_labels == 1
    tokenizer = load_tokenizer(str(out))
    model = load_reward_model(str(out), pad_token_id=tokenizer.pad_token_id)
    assert model.config.reward_gain == pytest.approx(metrics["gain"])
    assert model.config.reward_bias == pytest.approx(metrics["bias"])

    policy = load_causal_lm(tiny_model_dir).eval()
    queries = load_queries(str(tmp / "prompts.jsonl"), "text", tokenizer, 12) * 40
    responses = sample_responses(policy, tokenizer, queries, 8, 1.0, seed=987)
    assert {len(r) for r in responses} == {8}, "fixed-length samples: EOS must not stop them"
    worker = BatchWorker(0, 1, torch.device("cpu"), max_tokens=256)
    scores = score_sequences(model, [q + r for q, r in zip(queries, responses)], tokenizer.pad_token_id, worker,
                             normalized=True)
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
    from rl_core.reward_model.config import RMConfig, validate

    def load(*overrides):
        return load_config("rm_sentiment.yaml", list(overrides), RMConfig, validate)

    assert load().train.batch_size > 0
    with pytest.raises(ConfigError, match="labeler.name"):
        load("labeler.name=null")
    with pytest.raises(ConfigError, match="train.max_tokens_per_device"):
        load("data.max_length=128", "train.max_tokens_per_device=200")
    with pytest.raises(ConfigError, match="data.test_path"):
        load("data.train_path=/some/file.jsonl")


@pytest.mark.timeout(200)
def test_the_job_tells_its_progress_each_phase_for_the_stop_line(tiny_model_dir, tmp_path):
    """A stop signal's line names where the job was (`run_main`): the phases around the epoch, and each step of it
    as every job's step loop tells them, in the order the job runs them (one process, no process group)."""
    from rl_core.config import load_config
    from rl_core.distributed import DataParallel
    from rl_core.reward_model.config import RMConfig, validate
    from rl_core.reward_model.job import fit_and_export
    from rl_core.stop_signal import StepProgress

    class Recorded(StepProgress):
        def __init__(self):
            super().__init__()
            self.phases = []

        def at(self, step, phase):
            super().at(step, phase)
            self.phases.append((step, phase))

    _write_pairs(tmp_path / "train.jsonl", _pairs(0, 32))
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in OPENINGS))
    cfg = load_config("rm_sentiment.yaml", [
        f"model.policy_path={tiny_model_dir}", f"data.train_path={tmp_path / 'train.jsonl'}",
        f"data.test_path={tmp_path / 'train.jsonl'}", "data.max_length=48",
        f"normalize.prompts_path={tmp_path / 'prompts.jsonl'}", "normalize.query_length=12",
        "normalize.response_length=4", "normalize.num_samples=16", "normalize.truncate_token=null",
        "train.batch_size=16", "train.max_tokens_per_device=256", "trainer.progress=false", "labeler.name=null",
        f"trainer.run_dir={tmp_path / 'run'}"], RMConfig, validate)
    progress = Recorded()
    fit_and_export(cfg, DataParallel(), log=lambda line: None, progress=progress)
    assert progress.phases == [(None, "normalisation before training"), (1, "update"), (2, "update"), (2, "export"),
                               (None, "evaluation and normalisation after training"), (None, "export")]
    assert progress.where() == "during export"
