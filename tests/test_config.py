"""Config machinery shared by every job: one-line errors naming the key and the fix."""

import subprocess
import sys

import pytest

from rl_core.config import ConfigError, TrainerConfig, load_config, save_config
from rl_core.ppo.config import PPOConfig
from rl_core.ppo.validation import validate as validate_ppo
from rl_core.reward_model.config import RMConfig
from rl_core.reward_model.config import validate as validate_rm


def ppo(*overrides):
    return load_config("ppo_sentiment.yaml", list(overrides), PPOConfig, validate_ppo)


def test_recipe_loads_by_bare_name_and_overrides_apply():
    cfg = ppo("trainer.total_episodes=256", "async.max_staleness=3")
    assert isinstance(cfg, PPOConfig)
    assert cfg.trainer.total_episodes == 256
    assert cfg.async_.max_staleness == 3
    assert cfg.algorithm.kl.init_coef == 0.15  # OpenAI default survives the merge
    assert load_config("ppo_sentiment", [], PPOConfig).trainer.total_episodes == 4096


def test_every_job_shares_the_trainer_section():
    rm = load_config("rm_sentiment.yaml", ["trainer.seed=7"], RMConfig, validate_rm)
    assert isinstance(ppo().trainer, TrainerConfig) and isinstance(rm.trainer, TrainerConfig)
    assert rm.trainer.seed == 7 and rm.trainer.run_dir == "runs/rm_sentiment"
    assert ppo("trainer.seed=7").trainer.seed == 7


TRAINER_LINES = {"trainer.seed=-1": "config key 'trainer.seed' must be >= 0, got -1",
                 "trainer.collective_timeout_s=0": "config key 'trainer.collective_timeout_s' must be > 0"}
CHECKPOINT_LINES = {"trainer.save_every=-1": "config key 'trainer.save_every' must be >= 0",
                    "trainer.keep_last=-1": "config key 'trainer.keep_last' must be >= 0 (0 keeps every checkpoint)",
                    "trainer.on_checkpoint_error=skip": "config key 'trainer.on_checkpoint_error' = 'skip' is not one "
                                                        "of: stop, continue"}


@pytest.mark.parametrize("job", ["ppo", "rm", "sft", "dpo"])
def test_every_job_checks_the_trainer_section_with_the_same_lines(job):
    from rl_core.dpo.config import DPOConfig
    from rl_core.dpo.config import validate as validate_dpo
    from rl_core.sft.config import SFTConfig
    from rl_core.sft.config import validate as validate_sft

    recipe, schema, validate, lines = {
        "ppo": ("ppo_sentiment.yaml", PPOConfig, validate_ppo, {**TRAINER_LINES, **CHECKPOINT_LINES}),
        "rm": ("rm_sentiment.yaml", RMConfig, validate_rm, {**TRAINER_LINES, **CHECKPOINT_LINES}),
        "sft": ("sft_arithmetic.yaml", SFTConfig, validate_sft, {**TRAINER_LINES, **CHECKPOINT_LINES}),
        "dpo": ("dpo_sentiment.yaml", DPOConfig, validate_dpo, {**TRAINER_LINES, **CHECKPOINT_LINES}),
    }[job]
    for override, line in lines.items():
        with pytest.raises(ConfigError) as error:
            load_config(recipe, [override], schema, validate)
        assert str(error.value) == line


@pytest.mark.parametrize("job", ["ppo", "rm", "sft", "dpo"])
def test_profile_steps_are_step_numbers_within_the_run_in_every_job(job):
    from rl_core.dpo.config import DPOConfig
    from rl_core.dpo.config import validate as validate_dpo
    from rl_core.sft.config import SFTConfig
    from rl_core.sft.config import validate as validate_sft

    recipe, schema, validate = {
        "ppo": ("ppo_sentiment.yaml", PPOConfig, validate_ppo), "rm": ("rm_sentiment.yaml", RMConfig, validate_rm),
        "sft": ("sft_arithmetic.yaml", SFTConfig, validate_sft), "dpo": ("dpo_sentiment.yaml", DPOConfig, validate_dpo),
    }[job]
    assert load_config(recipe, [], schema, validate).trainer.profile_steps == []
    with pytest.raises(ConfigError) as error:
        load_config(recipe, ["trainer.profile_steps=[0,2]"], schema, validate)
    assert load_config(recipe, ["trainer.profile_steps=[2]"], schema, validate).trainer.profile_steps == [2]
    # PPO knows its steps from the config (checked in tests/ppo/test_profile.py); SFT, DPO and RM from the data.
    bound = "1..64, the run's steps (trainer.total_episodes=4096 / algorithm.batch_size=64)" if job == "ppo" \
        else "1 or more"
    assert str(error.value) == (f"trainer.profile_steps=[0, 2] names step(s) [0] outside {bound}; list steps of the "
                                "run, e.g. trainer.profile_steps=[3,4]")


PACKING_KEY = {"ppo": "algorithm.packing", "rm": "train.packing", "sft": "train.packing", "dpo": "train.packing"}


@pytest.mark.parametrize("job", ["ppo", "rm", "sft", "dpo"])
def test_every_job_has_the_same_model_run_keys_and_lines(job):
    """Sequence parallelism, LM-head chunks and activation checkpointing are one `model` section shape."""
    from rl_core.config import ModelRunConfig
    from rl_core.dpo.config import DPOConfig
    from rl_core.dpo.config import validate as validate_dpo
    from rl_core.sft.config import SFTConfig
    from rl_core.sft.config import validate as validate_sft

    recipe, schema, validate = {
        "ppo": ("ppo_sentiment.yaml", PPOConfig, validate_ppo), "rm": ("rm_sentiment.yaml", RMConfig, validate_rm),
        "sft": ("sft_arithmetic.yaml", SFTConfig, validate_sft), "dpo": ("dpo_sentiment.yaml", DPOConfig, validate_dpo),
    }[job]
    packed = f"{PACKING_KEY[job]}=true"
    cfg = load_config(recipe, [packed, "model.sequence_parallel=2", "model.logits_chunk=0",
                               "model.gradient_checkpointing=true"], schema, validate)
    assert isinstance(cfg.model, ModelRunConfig)
    assert (cfg.model.sequence_parallel, cfg.model.logits_chunk, cfg.model.gradient_checkpointing) == (2, 0, True)
    lines = {
        (f"{PACKING_KEY[job]}=false", "model.sequence_parallel=2"):
            "model.sequence_parallel=2 splits packed micro-batches; turn packing on (the job's packing key) or set "
            "model.sequence_parallel=1",
        (packed, "model.sequence_parallel=2", "model.attn_implementation=flash_attention_2"):
            "model.sequence_parallel=2 runs the model's kernel on whole packed rows with their mask, which "
            "model.attn_implementation=flash_attention_2's varlen layout has none of; use sdpa (null) or eager",
        ("model.sequence_parallel=0",): "config key 'model.sequence_parallel' must be >= 1 (1 = none), got 0",
        ("model.logits_chunk=-1",): "config key 'model.logits_chunk' must be >= 0 (0 = no chunks), got -1",
    }
    for overrides, line in lines.items():
        with pytest.raises(ConfigError) as error:
            load_config(recipe, list(overrides), schema, validate)
        assert str(error.value) == line


def test_typo_suggests_closest_key():
    with pytest.raises(ConfigError, match=r"unknown config key 'trainer.totl_steps'.*did you mean 'trainer\.\w+'"):
        ppo("trainer.totl_steps=10")
    with pytest.raises(ConfigError, match=r"'trainer.total_episode'.*did you mean 'trainer.total_episodes'"):
        ppo("trainer.total_episode=10")
    # A right key under the wrong section is found by its name.
    with pytest.raises(ConfigError, match=r"unknown config key 'seed'; did you mean 'trainer.seed'"):
        ppo("seed=2")
    with pytest.raises(ConfigError, match=r"unknown config key 'run_dir'; did you mean 'trainer.run_dir'"):
        load_config("rm_sentiment.yaml", ["run_dir=x"], RMConfig, validate_rm)


def test_wrong_type_names_key_and_expected_type():
    with pytest.raises(ConfigError, match=r"'algorithm.batch_size' must be int, got 'lots'"):
        ppo("algorithm.batch_size=lots")
    with pytest.raises(ConfigError, match=r"'rollout.ignore_eos' must be bool"):
        ppo("rollout.ignore_eos=3")
    with pytest.raises(ConfigError, match=r"'rollout.sglang_args' must be dict"):
        ppo("rollout.sglang_args=triton")


def test_values_outside_a_choice_list_the_allowed_ones():
    with pytest.raises(ConfigError, match=r"'trainer.mode' = 'fast' is not one of: sync, async"):
        ppo("trainer.mode=fast")
    with pytest.raises(ConfigError, match=r"'train.optimizer' = 'sgd' is not one of: adam, adamw, tf_adam"):
        load_config("rm_sentiment.yaml", ["train.optimizer=sgd"], RMConfig, validate_rm)


def test_missing_recipe_lists_available():
    with pytest.raises(ConfigError, match=r"config file 'nope.yaml' not found.*ppo_sentiment.yaml"):
        load_config("nope.yaml", [], PPOConfig)


def test_saved_config_round_trips(tmp_path):
    cfg = ppo("async.max_staleness=2", "env.kwargs.foo=1", "rollout.engine=sglang",
              "rollout.sglang_args.attention_backend=triton")
    save_config(cfg, tmp_path / "config.yaml")
    again = load_config(str(tmp_path / "config.yaml"), [], PPOConfig, validate_ppo)
    assert again == cfg and again.rollout.sglang_args == {"attention_backend": "triton"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("module", ["rl_core.train", "rl_core.train_rm"])
def test_cli_exits_with_one_line_and_no_traceback(module):
    # Validation happens before any process group or engine starts: the CLI prints one line.
    proc = subprocess.run([sys.executable, "-m", module, "trainer.totl_steps=5"],
                          capture_output=True, text=True, timeout=110)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "trainer.totl_steps" in lines[0] and "did you mean" in lines[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("module, recipe, lengths", [
    ("rl_core.train", "grpo_arithmetic.yaml", "data.max_prompt_length + rollout.response_length * rollout.max_turns"),
    ("rl_core.train_dpo", "dpo_sentiment.yaml", "data.max_length=96"),
])
def test_sequences_longer_than_the_models_context_stop_at_parse_time(tmp_path, module, recipe, lengths):
    from offline.arithmetic import ensure_arithmetic_assets
    from offline.families import save_family_model

    # A Llama with 64 positions: the recipe's sequences (84 and 96 tokens) do not fit it.
    tokenizer_dir = ensure_arithmetic_assets(log=lambda *_: None).model_dir
    model = save_family_model("llama", tokenizer_dir, tmp_path / "llama", max_position_embeddings=64)
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", module, "--config", recipe, f"model.path={model}",
                           f"trainer.run_dir={run_dir}"], capture_output=True, text=True, timeout=110)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lengths in lines[0] and f"the model's context of 64 (model.path={model})" in lines[0], lines[0]
    assert not run_dir.exists()  # stopped before the job's lifecycle: no run directory, no engine


def test_a_mistral_window_sglang_would_ignore_is_refused_at_parse_time(tmp_path):
    from rl_core.ppo.validation import check_models
    from offline.arithmetic import ensure_arithmetic_assets
    from offline.families import save_family_model

    tokenizer_dir = ensure_arithmetic_assets(log=lambda *_: None).model_dir
    short = save_family_model("mistral", tokenizer_dir, tmp_path / "short", sliding_window=32)
    long = save_family_model("mistral", tokenizer_dir, tmp_path / "long", sliding_window=512)
    grpo = lambda *keys: load_config("grpo_arithmetic.yaml", list(keys), PPOConfig, validate_ppo)  # noqa: E731
    with pytest.raises(ConfigError, match=r"sliding_window=32, which SGLang serves without its window .* sequences "
                                          r"reach 84 tokens; keep .* within 32, or use rollout.engine=embedded"):
        check_models(grpo(f"model.path={short}", "rollout.engine=sglang"))
    check_models(grpo(f"model.path={short}", "rollout.engine=embedded"))  # the embedded engine applies the window
    check_models(grpo(f"model.path={long}", "rollout.engine=sglang"))  # sequences within the window


def test_the_context_check_leaves_the_engines_reserve_for_the_policy_not_the_reward_model():
    from rl_core.ppo.validation import check_context_length

    grpo = lambda *keys: load_config("grpo_arithmetic.yaml", list(keys), PPOConfig, validate_ppo)  # noqa: E731
    cfg = grpo()  # 64 prompt tokens + 20 response tokens
    check_context_length(cfg, 86)  # SGLang serves 86 - 2 positions of a request
    with pytest.raises(ConfigError, match="84 tokens exceeds the 83 tokens the engines serve of the model's context "
                                          "of 85"):
        check_context_length(cfg, 85)
    check_context_length(cfg, 84, "reward.model_path=rm", served=False)  # the reward model reads it directly
    with pytest.raises(ConfigError, match=r"data.max_prompt_length=64 exceeds the longest input the engines accept "
                                          r"for the model's context of 70 \(63"):
        check_context_length(grpo("rollout.response_length=1"), 70)


def test_batches_in_flight_need_the_envs_and_concurrency_for_all_of_them():
    with pytest.raises(ConfigError, match=r"async.batches_in_flight=2 generates 2 x algorithm.batch_size=64 "
                                          r"trajectories at once, but env.num_envs=64 and rollout.concurrency=256 "
                                          r"allow 64: raise both to 128"):
        ppo("trainer.mode=async", "async.batches_in_flight=2", "algorithm.batch_size=64", "env.num_envs=64")
    assert ppo("trainer.mode=async", "async.batches_in_flight=2", "algorithm.batch_size=64",
               "env.num_envs=128").async_.batches_in_flight == 2
    with pytest.raises(ConfigError, match=r"'async.batches_in_flight' must be >= 1"):
        ppo("async.batches_in_flight=0")


def test_the_tool_timeout_must_fit_the_step_timeout_only_when_there_are_tools():
    grpo = lambda *keys: load_config("grpo_arithmetic.yaml", list(keys), PPOConfig, validate_ppo)  # noqa: E731
    grpo("env.step_timeout_s=2")  # no tools: the tool timeout does not matter
    with pytest.raises(ConfigError, match=r"'env.tool_timeout_s' \(30\) must be below env.step_timeout_s \(2\)"):
        grpo("env.step_timeout_s=2", "env.tools=[envs.arithmetic_tools:calc]")


# ------------------------------------------------------------------ model run keys and optimizer keys (issue 69)

JOBS = {"ppo": ("ppo_sentiment.yaml", "rl_core.ppo.config:PPOConfig", "rl_core.ppo.validation:validate", "algorithm"),
        "rm": ("rm_sentiment.yaml", "rl_core.reward_model.config:RMConfig", "rl_core.reward_model.config:validate",
               "train"),
        "sft": ("sft_arithmetic.yaml", "rl_core.sft.config:SFTConfig", "rl_core.sft.config:validate", "train"),
        "dpo": ("dpo_sentiment.yaml", "rl_core.dpo.config:DPOConfig", "rl_core.dpo.config:validate", "train")}


def job_config(job, *overrides):
    """`job`'s recipe loaded and validated with `overrides`, and the name of its optimizer section."""
    import importlib

    recipe, schema, validate, section = JOBS[job]
    schema, validate = (getattr(importlib.import_module(m), n) for m, n in (s.split(":") for s in (schema, validate)))
    return load_config(recipe, list(overrides), schema, validate), section


def one_line(job, *overrides) -> str:
    with pytest.raises(ConfigError) as error:
        job_config(job, *overrides)
    return str(error.value)


@pytest.mark.parametrize("job", ["ppo", "rm", "sft", "dpo"])
def test_every_job_model_section_takes_dtype_and_cpu_offload(job):
    import torch

    cfg, _ = job_config(job)
    assert (cfg.model.dtype, cfg.model.cpu_offload) == ("float32", False)  # the defaults: as before
    cfg, _ = job_config(job, "model.dtype=bfloat16", "model.cpu_offload=false")
    assert (cfg.model.dtype, cfg.model.cpu_offload) == ("bfloat16", False)
    assert one_line(job, "model.dtype=float64") == \
        "config key 'model.dtype' = 'float64' is not one of: float32, bfloat16, float16"
    # The suite hides the GPUs (tests/conftest.py), so offloading is refused at parse time, in one line.
    assert not torch.cuda.is_available()
    assert one_line(job, "model.cpu_offload=true") == (
        "model.cpu_offload=true offloads FSDP2's GPU shards to host memory, and this machine has no GPU (CUDA); "
        "set model.cpu_offload=false")


@pytest.mark.parametrize("job", ["ppo", "rm", "sft", "dpo"])
def test_every_job_training_section_takes_the_same_optimizer_keys(job):
    import dataclasses

    from rl_core.config import OptimizerConfig

    cfg, section = job_config(job)
    keys = {f.name for f in dataclasses.fields(OptimizerConfig)}
    assert keys == {"optimizer", "lr", "adam_eps", "adam_betas", "weight_decay", "max_grad_norm"}
    assert keys <= {f.name for f in dataclasses.fields(getattr(cfg, section))}
    cfg, _ = job_config(job, f"{section}.weight_decay=0.01", f"{section}.adam_betas=[0.8,0.99]")
    settings = getattr(cfg, section)
    assert settings.weight_decay == 0.01 and settings.adam_betas == (0.8, 0.99)  # YAML's list, kept as a tuple
    # Each broken key is one line naming its own section's key.
    assert one_line(job, f"{section}.lr=0") == f"config key '{section}.lr' must be > 0, got 0.0"
    assert one_line(job, f"{section}.lr=-1e-5") == f"config key '{section}.lr' must be > 0, got -1e-05"
    assert one_line(job, f"{section}.adam_betas=[0.9,1.0]") == \
        f"config key '{section}.adam_betas' must be two numbers in [0, 1), got (0.9, 1.0)"
    assert one_line(job, f"{section}.max_grad_norm=0") == \
        f"config key '{section}.max_grad_norm' must be > 0 or null, got 0.0"
    assert one_line(job, f"{section}.adam_betas=0.9") == (
        f"config key '{section}.adam_betas' must be list, got 0.9 (float); fix the recipe or pass "
        f"{section}.adam_betas=<list>")


@pytest.mark.parametrize("job", ["ppo", "rm"])
def test_ppo_and_rm_optimizer_sections_are_the_shared_one_with_their_own_defaults(job):
    from rl_core.config import OptimizerConfig
    from rl_core.ppo.config import AlgorithmConfig
    from rl_core.reward_model.config import RMTrainConfig

    cfg, section = job_config(job)
    assert isinstance(getattr(cfg, section), OptimizerConfig)
    defaults = {"ppo": AlgorithmConfig(), "rm": RMTrainConfig()}[job]
    lr = {"ppo": 1.41e-5, "rm": 5e-5}[job]
    assert (defaults.optimizer, defaults.lr, defaults.adam_eps, defaults.max_grad_norm) == ("adam", lr, 1e-5, None)
    assert (defaults.adam_betas, defaults.weight_decay) == ((0.9, 0.999), 0.0)  # the keys they gained
    # Keys the shared section checks that the two jobs did not check before.
    assert one_line(job, f"{section}.weight_decay=-0.1") == \
        f"config key '{section}.weight_decay' must be >= 0, got -0.1"
    assert one_line(job, f"{section}.adam_eps=0") == f"config key '{section}.adam_eps' must be > 0, got 0.0"


@pytest.mark.parametrize("job", ["sft", "dpo"])
def test_sft_and_dpo_optimizer_sections_are_the_shared_one_with_their_defaults_kept(job):
    from rl_core.config import OptimizerConfig
    from rl_core.finetune import FinetuneTrainConfig

    cfg, section = job_config(job)
    assert isinstance(getattr(cfg, section), OptimizerConfig)
    assert one_line(job, f"{section}.weight_decay=-0.1") == \
        f"config key '{section}.weight_decay' must be >= 0, got -0.1"
    tr = FinetuneTrainConfig()
    assert (tr.optimizer, tr.lr, tr.adam_eps, tr.adam_betas, tr.weight_decay, tr.max_grad_norm) == \
        ("adamw", 1e-5, 1e-8, (0.9, 0.999), 0.0, 1.0)


def test_a_critic_lr_must_be_positive():
    assert one_line("ppo", "algorithm.critic_lr=0") == \
        "config key 'algorithm.critic_lr' must be > 0 or null (= algorithm.lr), got 0.0"


def test_saved_config_with_the_new_keys_round_trips(tmp_path):
    from rl_core.reward_model.config import RMConfig
    from rl_core.reward_model.config import validate as validate_rm

    cfg, _ = job_config("rm", "model.dtype=bfloat16", "train.adam_betas=[0.8,0.99]", "train.weight_decay=0.01")
    save_config(cfg, tmp_path / "config.yaml")
    again = load_config(str(tmp_path / "config.yaml"), [], RMConfig, validate_rm)
    assert again == cfg and again.train.adam_betas == (0.8, 0.99) and again.model.dtype == "bfloat16"


def test_the_model_builder_loads_an_sft_run_in_its_dtype_with_its_optimizer(tiny_model_dir):
    import torch

    from rl_core.model_builder import Optimization, Placement, build_trained, load

    cfg, _ = job_config("sft", f"model.path={tiny_model_dir}", "model.dtype=bfloat16", "train.optimizer=adam",
                        "train.lr=3e-4", "train.adam_eps=1e-6", "train.adam_betas=[0.8,0.95]",
                        "train.weight_decay=0.01", "train.max_grad_norm=null")
    assert {p.dtype for p in load(tiny_model_dir, "causal_lm", cfg.model).parameters()} == {torch.bfloat16}
    assert {p.dtype for p in load(tiny_model_dir, "causal_lm", None).parameters()} == {torch.float32}  # own defaults
    optimization = Optimization.from_config(cfg.train)
    assert optimization == Optimization("adam", 3e-4, eps=1e-6, weight_decay=0.01, betas=(0.8, 0.95),
                                        max_grad_norm=None)
    trainable = build_trained(tiny_model_dir, "causal_lm", cfg.model, Placement.whole(torch.device("cpu")),
                              optimization)
    assert {p.dtype for p in trainable.model.parameters()} == {torch.bfloat16}
    group = trainable.optimizer.param_groups[0]
    assert type(trainable.optimizer) is torch.optim.Adam
    assert (group["lr"], group["eps"], group["betas"], group["weight_decay"]) == (3e-4, 1e-6, (0.8, 0.95), 0.01)


def test_ppo_builds_the_critic_with_its_own_lr_from_the_same_section():
    from rl_core.model_builder import Optimization

    cfg, _ = job_config("ppo", "algorithm.critic_lr=2e-5", "algorithm.adam_betas=[0.8,0.99]")
    actor, critic = Optimization.from_config(cfg.algorithm), Optimization.from_config(cfg.algorithm, lr=2e-5)
    assert (actor.lr, critic.lr) == (cfg.algorithm.lr, 2e-5)
    assert actor.betas == critic.betas == (0.8, 0.99) and actor.eps == critic.eps == cfg.algorithm.adam_eps
