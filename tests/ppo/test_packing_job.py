"""The PPO job with padding-free micro-batches (algorithm.packing): the same step as padded rows."""

import pytest

from tests.ppo.test_job import read_metrics, run_job, small_job  # noqa: F401  (fixture)

SAME = ("policy/loss", "value/loss", "policy/approx_kl", "policy/clipfrac", "kl/mean", "reward/score_mean",
        "policy/entropy", "value/vf_clipfrac", "policy/grad_norm", "value/grad_norm")


@pytest.mark.timeout(600)
def test_packed_ppo_step_equals_the_padded_one_with_less_padding(small_job, tmp_path):  # noqa: F811
    steps = {}
    for packing in ("false", "true"):
        run_dir = tmp_path / packing
        # Prompts of 12 to 54 tokens and responses that stop at EOS: rows of unequal length, so padding,
        # and short rows that two can share a packed row.
        run_job(small_job, run_dir, "trainer.total_episodes=32", "algorithm.batch_size=32",
                "data.max_prompt_length=54", "rollout.ignore_eos=false", "rollout.response_length=10",
                f"algorithm.packing={packing}")
        steps[packing] = read_metrics(run_dir)[-1]
    padded, packed = steps["false"], steps["true"]
    assert padded["step"] == packed["step"] == 1
    # The same initial weights and seeds sample the same batch; scoring and the update then see the
    # same tokens, so only the summation order differs.
    for key in SAME:
        assert packed[key] == pytest.approx(padded[key], rel=1e-4, abs=1e-6), key
    assert packed["perf/padding_fraction"] < padded["perf/padding_fraction"], (packed["perf/padding_fraction"],
                                                                               padded["perf/padding_fraction"])
