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


def test_engine_dtype_follows_the_training_compute_dtype_unless_set():
    assert engine_dtype(ppo()) == "float32"
    assert engine_dtype(ppo("model.mixed_precision=bf16")) == "bfloat16"
    assert engine_dtype(ppo("model.mixed_precision=bf16", "rollout.dtype=float32")) == "float32"
