"""The arithmetic GRPO recipe end to end at small settings: chat prompts, reward functions, group
advantages with nminibatches > 1, evaluation at step 0 and at the end (2 ranks, gloo, real engines)."""

import json

import pytest

from tests.jobs import read_metrics, undocumented_metrics
from tests.ppo.test_job import run_job, wait_gone


def run_arithmetic_job(job, run_dir, *extra):
    return run_job(job, run_dir, *extra, timeout=480, config="grpo_arithmetic.yaml")


@pytest.mark.timeout(600)
def test_arithmetic_recipe_logs_eval_at_step_0_and_at_the_end(arithmetic_job, arithmetic_run):
    # gradient checkpointing on: the key is wired through FSDP2 (the unit test below checks its gradients)
    run_dir, output = arithmetic_run
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]
    evaluated = [m["step"] for m in metrics if "eval/accuracy" in m]
    assert evaluated == [0, 2, 3]  # step 0, every 2 steps, and the end
    for m in (metrics[0], metrics[-1]):
        for key in ("eval/reward_mean", "eval/accuracy", "eval/pass@1", "eval/fn/correct", "eval/fn/format"):
            assert key in m, key
        assert m["eval/prompts"] == 12 and 0.0 <= m["eval/accuracy"] <= 1.0
    for m in metrics[1:]:  # training steps: every reward component on its own, groups by id, the KL in the loss
        for key in ("reward/fn/correct", "reward/fn/format", "reward/fn_total_mean", "rollout/truncated_frac",
                    "groups/count", "groups/zero_variance_frac", "policy/kl_loss", "data/prompts_skipped"):
            assert key in m, key
        assert m["groups/count"] == 4 and m["rollout/trajectories"] == 16
    rows = [json.loads(line) for line in (run_dir / "eval_samples.jsonl").read_text().splitlines()]
    assert {r["step"] for r in rows} == {0, 2, 3}
    assert rows[0]["query"].startswith("User: ") and rows[0]["query"].endswith("Assistant:")  # the chat template
    assert set(rows[0]) >= {"query", "response", "answer", "score", "correct"}
    assert "eval at step 0:" in output and "eval at step 3:" in output
    assert wait_gone(str(arithmetic_job["root"])) == []


@pytest.mark.timeout(600)
def test_dynamic_sampling_fills_the_batch_and_counts_what_it_dropped(arithmetic_job, tmp_path):
    run_dir = tmp_path / "dapo"
    # The untrained small policy never answers right, so every group has zero variance: dynamic sampling
    # launches up to 2x the groups a batch needs, then tops the batch up with dropped groups (and says so).
    run_arithmetic_job(arithmetic_job, run_dir, "trainer.total_episodes=32", "algorithm.filter_zero_variance_groups=true",
            "algorithm.filter_max_groups_factor=2", "algorithm.cliprange_high=0.28", "algorithm.loss_agg=token-mean",
            "algorithm.overlong_buffer=4", "data.eval_path=null", "eval.every=0")
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["rollout/trajectories"] == 16 and m["rollout/groups_kept"] == 4 and m["rollout/groups_launched"] <= 8
        # every launched group was kept by the filter or dropped; dropped ones topped the batch up
        assert m["rollout/groups_launched"] - m["rollout/groups_dropped"] + m["rollout/groups_filled"] == 4
        assert "reward/overlong_penalty_mean" in m
    assert undocumented_metrics(metrics) == []
    assert wait_gone(str(arithmetic_job["root"])) == []


def test_gradient_checkpointing_recomputes_without_changing_gradients(tiny_model_dir):
    import torch

    from workers.loading import enable_gradient_checkpointing
    from workers.loading import load_causal_lm

    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    grads = []
    for checkpointing in (False, True):
        model = load_causal_lm(tiny_model_dir)
        if checkpointing:
            enable_gradient_checkpointing(model)
            new_api = hasattr(model, "is_activation_checkpointing")
            assert model.is_activation_checkpointing if new_api else model.is_gradient_checkpointing
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1])
