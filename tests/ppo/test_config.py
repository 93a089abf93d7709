"""The PPO job's cross-field rules: impossible combinations stop before anything starts."""

import pytest

from rl_core.config import ConfigError, load_config
from rl_core.ppo.config import PPOConfig, engine_dtype, validate


def ppo(*overrides):
    return load_config("ppo_sentiment.yaml", list(overrides), PPOConfig, validate)


def test_impossible_combinations():
    with pytest.raises(ConfigError, match=r"batch_size=10 is not divisible into algorithm.nminibatches=4"):
        ppo("algorithm.batch_size=10", "algorithm.nminibatches=4")
    with pytest.raises(ConfigError, match=r"mem_fraction_static=1.5 cannot fit colocated"):
        ppo("rollout.mem_fraction_static=1.5")
    with pytest.raises(ConfigError, match=r"needs algorithm.group_size >= 2"):
        ppo("algorithm.advantage_estimator=grpo")
    with pytest.raises(ConfigError, match=r"rollout.sglang_args is set but rollout.engine is not sglang"):
        ppo("rollout.sglang_args.attention_backend=triton")
    with pytest.raises(ConfigError, match=r"max_tokens_per_device=32; raise it"):
        ppo("algorithm.max_tokens_per_device=32")
    with pytest.raises(ConfigError, match=r"'model.lora.dropout' must be 0 in the PPO job"):
        ppo("model.lora.rank=8", "model.lora.dropout=0.1")
    with pytest.raises(ConfigError, match=r"'model.lora.rank' must be >= 0"):
        ppo("model.lora.rank=-1")
    with pytest.raises(ConfigError, match=r"share_prompts=true packs a group's prompt once, so it needs algorithm.packing=true"):
        ppo("algorithm.share_prompts=true")
    with pytest.raises(ConfigError, match=r"flash_attention_2's varlen kernel cannot; set algorithm.share_prompts=false"):
        ppo("algorithm.packing=true", "algorithm.share_prompts=true", "model.attn_implementation=flash_attention_2")


def test_engine_dtype_follows_the_training_compute_dtype_unless_set():
    assert engine_dtype(ppo()) == "float32"
    assert engine_dtype(ppo("model.mixed_precision=bf16")) == "bfloat16"
    assert engine_dtype(ppo("model.mixed_precision=bf16", "rollout.dtype=float32")) == "float32"


def grpo(*overrides):
    return load_config("grpo_arithmetic.yaml", list(overrides), PPOConfig, validate)


def test_recipes_differ_where_they_should():
    sentiment, arithmetic = ppo(), grpo()
    # only the OpenAI recipe samples past EOS and cuts its queries to a fixed length, both on purpose
    assert sentiment.rollout.ignore_eos and sentiment.data.on_long_prompt == "truncate"
    assert not arithmetic.rollout.ignore_eos and arithmetic.data.on_long_prompt == "skip"
    assert arithmetic.algorithm.kl.placement == "loss" and sentiment.algorithm.kl.placement == "reward"


def test_reward_function_and_grpo_option_rules():
    with pytest.raises(ConfigError, match=r"reward.fns.bad' must be a mapping with fn"):
        grpo("reward.fns.bad.weight=1")
    with pytest.raises(ConfigError, match=r"unknown config key 'reward.fns.correct.wieght'"):
        grpo("reward.fns.correct.wieght=2")
    with pytest.raises(ConfigError, match=r"reward.fns.correct.weight' must be a number"):
        grpo("reward.fns.correct.weight=high")
    with pytest.raises(ConfigError, match=r"filter_zero_variance_groups needs rewards known at rollout time"):
        ppo("algorithm.advantage_estimator=grpo", "algorithm.group_size=4", "algorithm.filter_zero_variance_groups=true")
    with pytest.raises(ConfigError, match=r"works in trainer.mode=sync only"):
        grpo("algorithm.filter_zero_variance_groups=true", "trainer.mode=async")
    with pytest.raises(ConfigError, match=r"overlong_buffer=30 must be in \[0, rollout.response_length=20\]"):
        grpo("algorithm.overlong_buffer=30")
    with pytest.raises(ConfigError, match=r"start_text/end_text belong to OpenAI's query mode"):
        grpo("data.start_text=.")
    with pytest.raises(ConfigError, match=r"'algorithm.importance_ratio' = 'seq' is not one of: token, sequence"):
        grpo("algorithm.importance_ratio=seq")
