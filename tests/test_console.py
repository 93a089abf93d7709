"""`rl-core`, the console entry point: a job through torchrun as if torchrun had been typed, and the plot."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rl_core.console import torchrun_command

REPO = Path(__file__).resolve().parents[1]


def rl_core_command() -> list[str]:
    """The installed `rl-core` script (setup.cfg's console_scripts), beside this interpreter."""
    script = Path(sys.executable).parent / "rl-core"
    if not script.exists():
        found = shutil.which("rl-core")
        if found is None:
            pytest.skip("rl-core is not installed (pip install -e . puts it in the venv's bin)")
        script = Path(found)
    return [str(script)]


def test_a_job_goes_through_torchrun_and_its_config_error_is_the_jobs_one_line(tmp_path):
    ran = subprocess.run([*rl_core_command(), "train", "--config", "no_such_recipe.yaml", "--nproc", "1",
                          "trainer.total_episodes=8"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    out = ran.stdout + ran.stderr
    assert ran.returncode != 0
    assert "config error: config file 'no_such_recipe.yaml' not found" in out  # the job itself ran, under torchrun
    assert "rl_core.train FAILED" in out  # torchrun's own summary: it was torchrun that ran it


def test_the_command_is_torchrun_standalone_with_the_jobs_module():
    assert torchrun_command("sft", "sft_arithmetic.yaml", 2, ["trainer.max_steps=3"]) == [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "rl_core.train_sft", "--config", "sft_arithmetic.yaml", "trainer.max_steps=3"]


def test_bad_arguments_get_one_line_and_no_job():
    ran = subprocess.run([*rl_core_command(), "dpo", "--config", "dpo_sentiment.yaml", "--nproc", "0"],
                         capture_output=True, text=True, timeout=60)
    assert ran.returncode == 2 and "--nproc must be >= 1, got 0" in ran.stderr and "torch" not in ran.stderr


def test_plot_draws_the_learning_curves_of_a_run_dir(tmp_path):
    rows = [{"step": s, "reward/score_mean": 0.1 * s, "kl/mean": 0.01 * s, "perf/step_s": 1.0} for s in range(1, 5)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ran = subprocess.run([*rl_core_command(), "plot", str(tmp_path)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "MPLBACKEND": "Agg"})
    assert ran.returncode == 0, ran.stderr
    png = tmp_path / "learning_curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
