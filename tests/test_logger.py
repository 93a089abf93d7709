"""Run outputs: metrics.jsonl, samples, TensorBoard, and wandb (offline) when enabled and installed."""

import json

import pytest

from rl_core.logger import MetricsLogger


def test_metrics_and_samples_files_skip_non_finite_values(tmp_path):
    logger = MetricsLogger(tmp_path, {"seed": 1})
    logger.log(1, {"reward/score_mean": 0.5, "kl/mean": float("nan"), "perf/step_s": None})
    logger.log_samples(1, [{"query": "a | b", "response": "c", "score": 1.25}])
    logger.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "reward/score_mean": 0.5}
    assert json.loads((tmp_path / "samples.jsonl").read_text())["query"] == "a | b"
    assert any((tmp_path / "tensorboard").iterdir())


def test_wandb_offline_run_records_metrics_and_samples(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = MetricsLogger(tmp_path, {"seed": 1}, use_wandb=True, wandb_project="rl_core_test")
    logger.log(1, {"reward/score_mean": 0.5, "kl/mean": float("nan")})
    logger.log_samples(1, [{"query": "q", "response": "r", "score": 1.0}])
    logger.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, "one offline run under the run dir"
    record = runs[0].read_bytes()
    assert b"reward/score_mean" in record and b"samples" in record
    assert b"kl/mean" not in record, "non-finite values are left out, as in metrics.jsonl"
