"""scripts/bench_vs_trl.py --setting gpu86m runs on CPU at reduced size, so a GPU run can only fail on the GPU.

The whole script runs end to end (TRL's GRPOTrainer and the project's jobs, as on a GPU) with a
2-layer policy, a small batch and two batches; the figures it prints must describe the same work on
both sides and the project's phase split with its parts.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytest.importorskip("trl")


def test_gpu86m_runs_on_cpu_at_reduced_size_with_the_same_work_on_both_sides(tmp_path):
    prompts, group, batches, tokens = 4, 4, 2, 48
    argv = [sys.executable, "scripts/bench_vs_trl.py", "--setting", "gpu86m", "--device", "cpu", "--size", "tiny",
            "--batches", str(batches), "--prompts", str(prompts), "--group-size", str(group),
            "--workdir", str(tmp_path), "--project-runs", "sync", "release:trainer.mode=sync;rollout.release_memory=always",
            "bad:trainer.mode=sync;rollout.temperature=-1"]  # a variant that fails costs the table nothing
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 1 and "project bad failed" in proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "project bad: FAILED, left out of the table" in proc.stdout and "must be > 0" in proc.stdout
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["setting"] == "gpu86m" and out["device"] == "cpu"
    assert set(out["sides"]) == {"project sync", "project release", "TRL 1.16.0 position ids on"}
    for name, side in out["sides"].items():
        work = side["work"]
        assert work["completions"] == batches * prompts * group, name
        assert work["tokens"] == batches * prompts * group * tokens, name  # exactly 48 sampled tokens each
        assert work["optimizer_steps"] == batches * 2, name
        assert math.isfinite(side["reward_first"]) and -1 <= side["reward_last"] <= 1, name
        assert side["peak_gpu_gb"] is None and side["peak_pss_gb"] > 0, name
    for suffix in ("sync", "release"):
        phases, parts = out[f"phases_{suffix}"], out[f"parts_s_{suffix}"]
        assert set(phases) == {"rollout", "inference", "train", "sync"} and 0.9 < sum(phases.values()) <= 1.01
        assert {"push", "probe", "resume"} <= set(parts) and out[f"vs_trl_batches_per_s_{suffix}"] > 0
    # sync: the memory plan's auto, and on CPU a tiny job fits beside its engine: no release, nothing to resume;
    # rollout.release_memory=always releases every step and resumes in the push
    assert out["parts_s_sync"]["release"] == 0 and out["parts_s_sync"]["resume"] == 0
    # the last step is profiled, out of the timings: its reads of the device (the step's outputs gathered once,
    # its metrics once, the probe) and its outermost aten ops
    for suffix in ("sync", "release"):
        assert out[f"step_counts_{suffix}"]["device_reads"] == 3 and out[f"step_counts_{suffix}"]["kernel_ops"] > 100
    assert out["parts_s_release"]["release"] > 0 and out["parts_s_release"]["resume"] > 0
    # every prompt is 64 tokens, unpadded, for both sides' tokenizer calls
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "policy-tiny")
    rows = [json.loads(line)["prompt"] for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    assert len(rows) >= prompts * batches
    assert {len(tokenizer(r)["input_ids"]) for r in rows} == {64}
    assert {len(tokenizer(r, add_special_tokens=False)["input_ids"]) for r in rows} == {64}


def test_the_rollout_probe_times_every_shape_on_the_same_work(tmp_path):
    """scripts/gpu/rollout_probe.py (run after the benchmark on a GPU) on the embedded engine at reduced size:
    every request shape and transformers' generate sample the same sequences of exactly the asked length."""
    sys.path.insert(0, str(REPO / "scripts"))
    from bench_vs_trl import build_gpu86m_assets

    build_gpu86m_assets("tiny", pool=4, prompt_tokens=64, workdir=tmp_path)
    prompts, group, length = 3, 2, 5
    argv = [sys.executable, "scripts/gpu/rollout_probe.py", "--workdir", str(tmp_path), "--size", "tiny",
            "--engine", "embedded", "--prompts", str(prompts), "--group-size", str(group),
            "--response-length", str(length), "--repeats", "1"]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["sequences"] == prompts * group and out["device"] == "cpu"
    shapes = out["shapes"]
    assert set(shapes) == {"job", "direct", "no_logprob", "single", "one_call", "first_token", "two_batches",
                           "generate", "decode_step_s"}
    for name in ("job", "direct", "no_logprob", "single", "one_call", "generate"):
        assert shapes[name]["tokens"] == prompts * group * length and shapes[name]["median_s"] > 0, name
    assert shapes["first_token"]["tokens"] == prompts * group
    assert shapes["two_batches"]["tokens"] == 2 * prompts * group * length
