"""DPO: the loss and its implicit rewards by hand, pairs from every preference format, and the job
through torchrun (2 CPU ranks, gloo): it starts at log 2, learns, evaluates with a reward model,
exports, and one rank and two give the same losses."""

import json
import math

import pytest
import torch

from rl_core.dpo.training import dpo_losses, to_pairs
from rl_core.preferences import TokenizedPreference
from tests.jobs import read_metrics, run_to_end, torchrun, undocumented_metrics


def test_the_loss_is_log_2_at_the_reference_and_follows_the_implicit_reward_margin():
    policy_c, policy_r = torch.tensor([-3.0, -5.0]), torch.tensor([-4.0, -2.0])
    ref_c, ref_r = torch.tensor([-3.5, -5.0]), torch.tensor([-3.5, -3.0])
    losses, chosen, rejected = dpo_losses(ref_c, ref_r, ref_c, ref_r, beta=0.1, label_smoothing=0.0)
    assert losses.tolist() == pytest.approx([math.log(2)] * 2) and chosen.abs().sum() == 0
    losses, chosen, rejected = dpo_losses(policy_c, policy_r, ref_c, ref_r, beta=0.5, label_smoothing=0.0)
    assert chosen.tolist() == pytest.approx([0.25, 0.0]) and rejected.tolist() == pytest.approx([-0.25, 0.5])
    margin = torch.tensor([0.5, -0.5])
    assert losses.tolist() == pytest.approx((-torch.nn.functional.logsigmoid(margin)).tolist())
    smoothed, _, _ = dpo_losses(policy_c, policy_r, ref_c, ref_r, beta=0.5, label_smoothing=0.2)
    expected = 0.8 * -torch.nn.functional.logsigmoid(margin) + 0.2 * -torch.nn.functional.logsigmoid(-margin)
    assert smoothed.tolist() == pytest.approx(expected.tolist())


def test_best_of_n_becomes_the_best_against_each_other_response():
    example = TokenizedPreference([[1, 2, 10], [1, 2, 11], [1, 2, 12], [1, 2, 13]], prompt_length=2, best=2, margin=0.0)
    pairs = to_pairs([example])
    assert [(p.chosen[-1], p.rejected[-1]) for p in pairs] == [(12, 10), (12, 11), (12, 13)]
    assert all(p.prompt_length == 2 and p.tokens == 6 for p in pairs)


def test_reward_model_evaluation_rows_must_fit_the_micro_batch_they_are_scored_in():
    from rl_core.config import ConfigError, load_config
    from rl_core.dpo.config import DPOConfig, validate

    def load(*overrides):
        return load_config("dpo_sentiment.yaml", ["eval.reward_model_path=some/rm", *overrides], DPOConfig, validate)

    assert load("eval.query_length=40", "eval.response_length=24", "train.max_tokens_per_device=256")
    with pytest.raises(ConfigError, match=r"eval.query_length \+ eval.response_length = 264 tokens do not fit one "
                                          r"micro-batch of train.max_tokens_per_device=256"):
        load("eval.query_length=240", "eval.response_length=24", "train.max_tokens_per_device=256",
             "data.max_length=64")


@pytest.fixture(scope="module")
def dpo_job(tmp_path_factory):
    from offline.assets import ensure_tiny_assets
    from offline.reward_model import ensure_tiny_preferences, ensure_tiny_reward_model

    quiet = lambda *_: None  # noqa: E731
    tiny = ensure_tiny_assets(tmp_path_factory.mktemp("dpo_assets"), small=True, log=quiet)
    train, test = ensure_tiny_preferences(tiny, "sentiment", quiet, small=True, progress=False)
    reward_model = ensure_tiny_reward_model(tiny, log=quiet, small=True, progress=False)
    # Evaluated on its own training pairs: the small labels carry too little signal to generalise,
    # but fitting them shows the loss, gradients and implicit rewards at work.
    return [f"model.path={tiny.model_dir}", f"data.train_path={train}", f"data.test_path={train}",
            f"eval.reward_model_path={reward_model}", "data.max_length=64", "train.batch_size=4", "train.epochs=4",
            "train.lr=1e-3", "train.schedule=constant", "train.warmup_steps=0", "train.max_tokens_per_device=512",
            "eval.prompts=8", "eval.query_length=16", "eval.response_length=8", "data.eval_max_pairs=32",
            "trainer.progress=false"]


def run_dpo(overrides, run_dir, *extra, ranks=2):
    return run_to_end(torchrun("rl_core.train_dpo", "dpo_sentiment.yaml", *overrides, f"trainer.run_dir={run_dir}",
                               *extra, ranks=ranks), timeout=300)


@pytest.fixture(scope="module")
def two_ranks(dpo_job, tmp_path_factory):
    """8 steps on 2 ranks, step 1 profiled: (run_dir, output). One launch serves the learning test and the
    profile test (profiling leaves the numbers as they are)."""
    run_dir = tmp_path_factory.mktemp("dpo_two_ranks") / "two"
    output = run_dpo(dpo_job, run_dir, "train.max_steps=8", "eval.every=4", "trainer.profile_steps=[1]")
    return run_dir, output


@pytest.mark.timeout(900)
def test_dpo_starts_at_log_2_learns_and_one_rank_matches_two(dpo_job, two_ranks, tmp_path):
    from transformers import AutoModelForCausalLM

    two, output = two_ranks
    rows = read_metrics(two)
    assert [r["step"] for r in rows] == list(range(9))
    first, last = rows[0], rows[-1]
    assert first["eval/loss"] == pytest.approx(math.log(2), abs=1e-5)  # the policy starts as the reference
    assert first["eval/reward_margin"] == pytest.approx(0.0, abs=1e-5)
    assert last["eval/loss"] < first["eval/loss"] and last["eval/reward_margin"] > 0
    assert last["eval/reward_accuracy"] > 0.5
    assert "eval/rm_score" in first and "eval/rm_score" in last
    for key in ("train/logps_chosen", "train/logps_rejected", "train/reward_chosen", "train/reward_rejected"):
        assert key in rows[1]
    assert undocumented_metrics(rows) == [], "add these to rl_core/metric_docs/"
    assert AutoModelForCausalLM.from_pretrained(two / "final") is not None and "final model saved" in output

    one = tmp_path / "one"
    run_dpo(dpo_job, one, "train.max_steps=8", "eval.every=4", ranks=1)
    two_losses = [r["train/loss"] for r in rows[1:]]
    assert [r["train/loss"] for r in read_metrics(one)[1:]] == pytest.approx(two_losses, rel=1e-4, abs=1e-5)


@pytest.mark.timeout(600)
def test_dpo_with_lora_adapters_learns_against_the_frozen_base(dpo_job, tmp_path):
    run_dir = tmp_path / "lora"
    run_dpo(dpo_job, run_dir, "train.max_steps=8", "model.lora.rank=4", "model.lora.alpha=8", "train.lr=1e-2")
    rows = read_metrics(run_dir)
    assert rows[0]["eval/loss"] == pytest.approx(math.log(2), abs=1e-5)  # adapters start at zero
    assert rows[-1]["eval/loss"] < rows[0]["eval/loss"] and rows[-1]["eval/reward_margin"] > 0
    assert (run_dir / "final" / "model.safetensors").exists()  # merged by default


@pytest.mark.timeout(600)
def test_profile_steps_trace_the_listed_step_on_each_rank(two_ranks):
    run_dir, output = two_ranks  # the shared 2-rank run profiles step 1
    for rank in (0, 1):
        path = run_dir / "profile" / "step_1" / f"rank{rank}.pt.trace.json"
        assert f"[rank {rank}] profile of step 1: {path}\n" in output
        names = {e["name"] for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"}
        assert "train step" in names and any(name.startswith("FSDP::") for name in names)
    assert sorted(p.name for p in (run_dir / "profile").iterdir()) == ["step_1"]
