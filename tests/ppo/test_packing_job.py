"""The PPO job with padding-free micro-batches (algorithm.packing, share_prompts), and with each micro-batch's
tokens split over both ranks (model.sequence_parallel=2): the same step as padded rows."""

import pytest

from tests.jobs import read_metrics
from tests.ppo.test_job import run_job

SAME = ("policy/loss", "value/loss", "policy/approx_kl", "policy/clipfrac", "kl/mean", "reward/score_mean",
        "policy/entropy", "value/vf_clipfrac", "policy/grad_norm", "value/grad_norm")


@pytest.mark.timeout(900)
def test_packed_ppo_step_equals_the_padded_one_with_less_padding(small_job, tmp_path):
    steps = {}
    layouts = {"padded": ["algorithm.packing=false"], "packed": ["algorithm.packing=true"],
               "shared": ["algorithm.packing=true", "algorithm.share_prompts=true"],
               "split": ["algorithm.packing=true", "algorithm.share_prompts=true", "model.sequence_parallel=2"]}
    for name, keys in layouts.items():
        run_dir = tmp_path / name
        # Prompts of 12 to 54 tokens and responses that stop at EOS: rows of unequal length, so padding,
        # and short rows that two can share a packed row; 4 responses per prompt for shared prompts.
        run_job(small_job, run_dir, "trainer.total_episodes=32", "algorithm.batch_size=32", "algorithm.group_size=4",
                "data.max_prompt_length=52", "rollout.ignore_eos=false", "rollout.response_length=10", *keys)
        steps[name] = read_metrics(run_dir)[-1]
    padded = steps["padded"]
    assert padded["step"] == steps["packed"]["step"] == steps["shared"]["step"] == 1
    # The same initial weights and seeds sample the same batch; scoring and the update then see the
    # same tokens, so only the summation order differs.
    for key in SAME:
        assert steps["packed"][key] == pytest.approx(padded[key], rel=1e-4, abs=1e-6), key
    # Shared prompts keep a group's rows on one rank, so each rank holds other rows than above and averages
    # taken per micro-batch (clip fraction, entropy) differ; the global loss and what every rank agrees on must not.
    # Split over a sequence group (dp 1 x sp 2: actor, reference and critic on half of each micro-batch's
    # tokens) the same holds: the one loss-scaling rule stays exact.
    for key in ("policy/loss", "policy/grad_norm", "value/grad_norm", "kl/mean", "reward/score_mean"):
        assert steps["shared"][key] == pytest.approx(padded[key], rel=1e-4, abs=1e-6), key
        assert steps["split"][key] == pytest.approx(padded[key], rel=1e-4, abs=1e-6), key
    assert steps["packed"]["perf/padding_fraction"] < padded["perf/padding_fraction"]
    # a group's prompt once instead of 4 times: fewer positions run than packing alone
    grid = {name: step["perf/train_grid_tokens"] for name, step in steps.items()}
    assert grid["shared"] < grid["packed"] < grid["padded"], grid
