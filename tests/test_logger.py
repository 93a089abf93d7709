"""Run outputs: metrics.jsonl, samples, TensorBoard, and wandb (offline) when enabled and installed."""

import json
import time

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
    # wandb's own service process writes the offline file; on a loaded machine it can lag finish().
    deadline = time.monotonic() + 60
    while b"samples" not in (record := runs[0].read_bytes()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert b"reward/score_mean" in record and b"samples" in record
    assert b"kl/mean" not in record, "non-finite values are left out, as in metrics.jsonl"


def test_a_resumed_logger_drops_rows_after_the_checkpoint_and_duplicates(tmp_path):
    # What a run stopped at step 5 after its step-4 checkpoint leaves behind, plus an old duplicate
    # of step 2 and a line cut short by a kill.
    rows = [{"step": s, "x": s} for s in (1, 2, 2, 3, 4, 5)]
    rows[1]["x"] = -1  # the superseded copy of step 2
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 6, "x"')
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps({"step": s, "query": "q"}) + "\n" for s in (1, 1, 5)))
    logger = MetricsLogger(tmp_path, {"seed": 1}, resume_step=4)
    logger.log(5, {"x": 50.0})
    logger.log_samples(5, [{"query": "q", "response": "r", "score": 0.0}])
    logger.close()
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(m["step"], m["x"]) for m in metrics] == [(1, 1), (2, 2), (3, 3), (4, 4), (5, 50.0)]
    samples = [json.loads(line)["step"] for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert samples == [1, 1, 5]


def test_tensorboard_purges_steps_after_the_resume_point(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = MetricsLogger(tmp_path, {"seed": 1})
    for step in (1, 2, 3):
        first.log(step, {"x": float(step)})
    first.close()
    resumed = MetricsLogger(tmp_path, {"seed": 1}, resume_step=1)
    for step in (2, 3):
        resumed.log(step, {"x": 10.0 * step})
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("x")] == [(1, 1.0), (2, 20.0), (3, 30.0)]
