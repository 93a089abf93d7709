"""Config loading: every bad-config case stops with one line naming the key and the fix."""

import subprocess
import sys

import pytest

from rl_core.config import ConfigError, JobConfig, load_config, save_config


def test_recipe_loads_by_bare_name_and_overrides_apply():
    cfg = load_config("ppo_sentiment.yaml", ["trainer.total_episodes=256", "async.max_staleness=3"])
    assert isinstance(cfg, JobConfig)
    assert cfg.trainer.total_episodes == 256
    assert cfg.async_.max_staleness == 3
    assert cfg.algorithm.kl.init_coef == 0.15  # OpenAI default survives the merge
    assert load_config("ppo_sentiment").trainer.total_episodes == 4096


def test_typo_suggests_closest_key():
    with pytest.raises(ConfigError, match=r"unknown config key 'trainer.totl_steps'.*did you mean 'trainer\.\w+'"):
        load_config("ppo_sentiment.yaml", ["trainer.totl_steps=10"])
    with pytest.raises(ConfigError, match=r"'trainer.total_episode'.*did you mean 'trainer.total_episodes'"):
        load_config("ppo_sentiment.yaml", ["trainer.total_episode=10"])


def test_wrong_type_names_key_and_expected_type():
    with pytest.raises(ConfigError, match=r"'algorithm.batch_size' must be int, got 'lots'"):
        load_config("ppo_sentiment.yaml", ["algorithm.batch_size=lots"])
    with pytest.raises(ConfigError, match=r"'rollout.ignore_eos' must be bool"):
        load_config("ppo_sentiment.yaml", ["rollout.ignore_eos=3"])


def test_impossible_combinations():
    with pytest.raises(ConfigError, match=r"batch_size=10 is not divisible into algorithm.nminibatches=4"):
        load_config("ppo_sentiment.yaml", ["algorithm.batch_size=10", "algorithm.nminibatches=4"])
    with pytest.raises(ConfigError, match=r"not one of: sync, async"):
        load_config("ppo_sentiment.yaml", ["trainer.mode=fast"])
    with pytest.raises(ConfigError, match=r"mem_fraction_static=1.5 cannot fit colocated"):
        load_config("ppo_sentiment.yaml", ["rollout.mem_fraction_static=1.5"])
    with pytest.raises(ConfigError, match=r"needs algorithm.group_size >= 2"):
        load_config("ppo_sentiment.yaml", ["algorithm.advantage_estimator=grpo"])


def test_missing_recipe_lists_available():
    with pytest.raises(ConfigError, match=r"config file 'nope.yaml' not found.*ppo_sentiment.yaml"):
        load_config("nope.yaml")


def test_saved_config_round_trips(tmp_path):
    cfg = load_config("ppo_sentiment.yaml", ["async.max_staleness=2", "env.kwargs.foo=1"])
    save_config(cfg, tmp_path / "config.yaml")
    again = load_config(str(tmp_path / "config.yaml"))
    assert again == cfg


@pytest.mark.timeout(120)
def test_cli_exits_with_one_line_and_no_traceback():
    # Validation happens before any process group or engine starts: the CLI prints one line.
    proc = subprocess.run(
        [sys.executable, "-m", "rl_core.train", "--config", "ppo_sentiment.yaml", "trainer.totl_steps=5"],
        capture_output=True, text=True, timeout=110,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "trainer.totl_steps" in lines[0] and "did you mean" in lines[0]
