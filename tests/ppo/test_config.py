"""The PPO job's cross-field rules: impossible combinations stop before anything starts."""

import pytest

from rl_core.config import ConfigError, load_config
from rl_core.ppo.config import PPOConfig, engine_dtype
from rl_core.ppo.validation import validate


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


def test_release_memory_takes_the_three_modes_and_the_old_booleans():
    from rl_core.ppo.config import release_mode

    assert release_mode(ppo().rollout) == "auto"  # the default: the memory plan decides
    assert release_mode(ppo("rollout.release_memory=true").rollout) == "always"
    assert release_mode(ppo("rollout.release_memory=false").rollout) == "never"
    assert release_mode(ppo("rollout.release_memory=never").rollout) == "never"
    with pytest.raises(ConfigError, match=r"rollout.release_memory' = 'sometimes' is not one of: auto, always"):
        ppo("rollout.release_memory=sometimes")
    with pytest.raises(ConfigError, match=r"rollout.kv_tokens and rollout.sglang_args.max_total_tokens both set"):
        ppo("rollout.engine=sglang", "rollout.kv_tokens=4096", "rollout.sglang_args.max_total_tokens=8192")
    with pytest.raises(ConfigError, match=r"'rollout.device_memory_gb' must be > 0"):
        ppo("rollout.device_memory_gb=0")
    with pytest.raises(ConfigError, match=r"'rollout.node_timeout_s' must be >= 3 \(seconds\), got 0.5"):
        ppo("rollout.node_timeout_s=0.5")


def test_the_memory_plan_reads_which_models_train_and_what_the_rollout_keeps_in_flight():
    from transformers import GPT2Config

    from rl_core.ppo.memory import memory_inputs
    from workers.memory_plan import GIB, Device

    policy = GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=1000, n_positions=128)
    cpu, gpu = Device.of("cpu", 8 * GIB), Device.of("cuda", 80 * GIB)
    # The sentiment recipe: actor and critic trained, reference and reward model frozen, fp32 throughout;
    # 64 episodes of 64 + 24 tokens, all in flight (num_envs 64), over 2 engines.
    ppo_inputs = memory_inputs(ppo(), policy, reward_params=1234, dp_size=2, device=cpu, context_length=128)
    assert ppo_inputs.trained_models == 2 and ppo_inputs.frozen_params == ppo_inputs.policy.params + 1234
    assert (ppo_inputs.master_dtype_bytes, ppo_inputs.compute_dtype_bytes, ppo_inputs.engine_dtype_bytes) == (4, 4, 4)
    assert (ppo_inputs.sequences_in_flight, ppo_inputs.sequence_tokens, ppo_inputs.engines) == (64, 88, 2)
    assert ppo_inputs.min_kv_tokens == 128 and ppo_inputs.engine_static_bytes is None
    # GRPO without KL, LoRA, bf16, async, on SGLang on a GPU: no critic, the LoRA base frozen, 2 batches in
    # flight, SGLang's static share caps the pool, fewer envs than episodes bound what is in flight.
    grpo = ppo("algorithm.advantage_estimator=grpo", "algorithm.group_size=4", "algorithm.kl.init_coef=0",
               "algorithm.kl.adaptive=false", "model.lora.rank=8", "model.mixed_precision=bf16", "trainer.mode=async",
               "rollout.engine=sglang", "env.num_envs=16", "reward.model_path=null")
    grpo_inputs = memory_inputs(grpo, policy, reward_params=0, dp_size=1, device=gpu, context_length=128)
    assert grpo_inputs.trained_models == 0 and grpo_inputs.frozen_params == grpo_inputs.policy.params
    assert (grpo_inputs.compute_dtype_bytes, grpo_inputs.engine_dtype_bytes) == (2, 2)
    assert (grpo_inputs.sequences_in_flight, grpo_inputs.batches_in_flight) == (16, 2)
    assert grpo_inputs.engine_static_bytes == int(0.6 * 80 * GIB)
    # A pool set by hand, either way, is the plan's.
    assert memory_inputs(ppo("rollout.kv_tokens=777"), policy, 0, 1, cpu, 128).kv_tokens == 777
    sglang_pool = ppo("rollout.engine=sglang", "rollout.sglang_args.max_total_tokens=999")
    assert memory_inputs(sglang_pool, policy, 0, 1, cpu, 128).kv_tokens == 999


def test_a_model_the_plan_cannot_read_leaves_the_job_on_the_safe_old_behaviour(tmp_path, capsys):
    from rl_core.ppo.memory import decide, plan_job_memory
    from workers.memory_plan import GIB, Device

    (tmp_path / "config.json").write_text('{"model_type": "no-such-family"}')
    cfg = ppo(f"model.path={tmp_path}", "reward.model_path=null")
    assert plan_job_memory(cfg, Device.of("cuda", 80 * GIB), 1, None) is None
    assert "memory plan unavailable" in capsys.readouterr().out
    assert decide("auto", None) and decide("always", None) and not decide("never", None)


def test_samples_carry_sampling_seeds_only_where_the_engines_honour_them():
    """Seeds make a resumed run sample what the uninterrupted one would have; SGLang ignores them unless it runs
    deterministic inference, and unseeded groups go to the engines as one n = group_size call each."""
    assert ppo().rollout.samples_seeded and not ppo("rollout.seeded=false").rollout.samples_seeded
    assert not ppo("rollout.engine=sglang").rollout.samples_seeded
    assert ppo("rollout.engine=sglang", "rollout.sglang_args.enable_deterministic_inference=true").rollout.samples_seeded


def test_old_logprobs_come_from_the_engine_within_the_precision_in_use():
    """A bf16 engine and trainer differ by ~2e-3 nats from rounding alone (H200, gpu86m): with a float32
    threshold of 1e-3 every step recomputed pi_old for nothing."""
    from rl_core.ppo.config import old_logprobs_max_gap
    from rl_core.ppo.config import engine_old_logprobs_max_gap

    def old_logprobs_from_engine(cfg, probe_gap):
        return probe_gap <= engine_old_logprobs_max_gap(cfg)

    fp32, bf16 = ppo(), ppo("model.mixed_precision=bf16")
    mixed = ppo("rollout.dtype=bfloat16")  # fp32 trainer, bf16 engine
    assert (old_logprobs_max_gap(fp32), old_logprobs_max_gap(bf16), old_logprobs_max_gap(mixed)) == (1e-3, 1e-2, 1e-2)
    assert old_logprobs_from_engine(bf16, 2e-3) and not old_logprobs_from_engine(fp32, 2e-3)
    assert not old_logprobs_from_engine(bf16, 0.05)  # more than rounding (other kernels, stale weights): recomputed
    assert not old_logprobs_from_engine(ppo("model.mixed_precision=bf16", "algorithm.old_logprobs_max_gap=1e-3"), 2e-3)
    assert not old_logprobs_from_engine(ppo("model.mixed_precision=bf16", "trainer.mode=async"), 0.0)
