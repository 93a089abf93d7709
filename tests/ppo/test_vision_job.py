"""A vision-language policy through the GRPO job as a user runs it (issue 71): torchrun on 2 CPU ranks with the
embedded engine, and on 1 rank with the real SGLang server on CPU, prompts whose chat messages carry an image each,
a tiny random Qwen2.5-VL built here.

The engine is sent one image pad per image with the images (SGLang's convention) and the trainer trains on the
processor's expanded ids: the trainer's recomputed pi_old on the sampled tokens must equal the engine's
sampling logprobs (`rollout/behaviour_logprob_gap`), the weight push (vision tower included) must leave engine
and trainer equal, and `final/` must load back as the same vision-language model.

    python -m pytest tests/ppo/test_vision_job.py
"""

import json

import pytest

from offline.vision import save_vision_model, write_colour_prompts
from tests.jobs import read_metrics, run_to_end
from tests.ppo.test_job import torchrun_argv, wait_gone
from tests.sglang_env import require_sglang_python
from workers.vision import load_processor, vision_inputs

MAX_GAP = 1e-3  # float32 on both sides: a correct push and expansion leave rounding error only
@pytest.mark.timeout(900)
@pytest.mark.parametrize("engine", ["embedded", "sglang"])
def test_a_grpo_job_trains_a_vision_language_policy_on_exactly_what_the_engine_sampled(tiny_model_dir, tmp_path,
                                                                                         engine):
    from transformers import AutoConfig, AutoModelForImageTextToText

    # SGLang on one rank: its server costs a rank's worth of start-up; the 2-rank layout is the embedded run's
    engine_keys = [] if engine == "embedded" else ["rollout.engine=sglang",
                                                   f"rollout.sglang_python={require_sglang_python()}"]

    model_dir = save_vision_model("qwen2_5_vl", tiny_model_dir, tmp_path / "model")
    prompts = write_colour_prompts(tmp_path)
    run_dir = tmp_path / "run"
    output = run_to_end(torchrun_argv([
        f"model.path={model_dir}", f"data.train_path={prompts}", "data.eval_path=null", "eval.every=0",
        "data.max_prompt_length=128", "algorithm.batch_size=8", "algorithm.group_size=4", "env.num_envs=8",
        "rollout.response_length=8", "trainer.total_episodes=16", "trainer.progress=false",
        "algorithm.share_prompts=false",  # rows of the same text show different images (the job refuses it)
        "env.max_failed_ratio=0.5",  # a random policy samples <|image_pad|> now and then: that trajectory fails
        "algorithm.old_logprobs=trainer",  # recompute pi_old, so the gap to the engine's logprobs is measured
        f"trainer.run_dir={run_dir}", f"rollout.weight_check_tolerance={MAX_GAP}", *engine_keys],
        config="grpo_arithmetic.yaml", ranks=2 if engine == "embedded" else 1), timeout=840)
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2], output[-3000:]
    assert "memory plan unavailable" not in output and metrics[0]["memory_plan/trainer_params_gib"] > 0
    for row in metrics:
        assert 0 <= row["weight_sync/probe_gap"] < MAX_GAP
        # every sampled token, image-conditioned: the trainer's logprob of it is the engine's
        assert row["rollout/behaviour_logprob_gap"] < MAX_GAP, row["rollout/behaviour_logprob_gap"]
        assert row["perf/old_logprobs_from_engine"] == 0.0
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples  # (queries are logged as text, special tokens such as the vision ones left out)
    final = AutoModelForImageTextToText.from_pretrained(run_dir / "final")
    assert final.config.model_type == AutoConfig.from_pretrained(model_dir).model_type
    # the export carries the processor an engine serving it expands image pads by, as the trainer did
    exported = vision_inputs(load_processor(run_dir / "final"), [tmp_path / "red.png"])
    assert exported["image_grid_thw"].tolist() == vision_inputs(load_processor(model_dir),
                                                                [tmp_path / "red.png"])["image_grid_thw"].tolist()
    assert wait_gone(str(tmp_path)) == []
