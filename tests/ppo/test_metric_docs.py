"""docs/metrics.md explains every metric the PPO job logs: every name in the rows of real runs (PPO with a critic
in sync and async mode, profiled; the arithmetic GRPO recipe with evaluations) has an entry in
rl_core/metric_docs/. The runs are the session's shared ones (tests/ppo/conftest.py), so this costs no job of
its own; the dynamic-sampling, tool and agent jobs check their rows the same way (`undocumented_metrics`)."""

import pytest

from rl_core.metric_docs import GROUPS, METRICS, describe, undocumented
from tests.jobs import read_metrics, undocumented_metrics


@pytest.mark.timeout(900)
def test_every_metric_the_ppo_and_grpo_runs_log_has_an_entry(sync_run, async_run, arithmetic_run):
    names = set()
    for run_dir, _ in (sync_run, async_run, arithmetic_run):
        rows = read_metrics(run_dir)
        assert undocumented_metrics(rows) == [], f"{run_dir}: add these to rl_core/metric_docs/"
        names |= {name for row in rows for name in row}
    # the runs reach every family the check is for: a critic, async, the profiler, the plan, groups, evaluation
    for name in ("value/loss", "async/batches_taken", "profile/kernel_ops", "memory_plan/fits", "groups/count",
                 "eval/accuracy", "eval/pass@1", "eval/fn/correct", "reward/fn/format", "weight_sync/probe_gap"):
        assert name in names, name


def test_a_pattern_stands_for_one_path_segment_and_every_entry_is_complete():
    assert describe("reward/fn/correct") is METRICS["reward/fn/<name>"]
    assert describe("eval/pass@16") is METRICS["eval/pass@<k>"]
    assert describe("policy/clipfrac") is METRICS["policy/clipfrac"]
    assert undocumented(["reward/fn/a/b", "policy/clipfrac", "policy/clip"]) == ["policy/clip", "reward/fn/a/b"]
    assert len(METRICS) == sum(len(group.metrics) for group in GROUPS)  # no name in two groups
    for metric in METRICS.values():
        assert metric.unit and metric.meaning.endswith(".") and metric.healthy.endswith("."), metric.name


def test_every_tool_error_kind_has_an_entry():
    from envs.tools import ERROR_KINDS

    assert [kind for kind in ERROR_KINDS if f"rollout/tool_errors/{kind}" not in METRICS] == []
