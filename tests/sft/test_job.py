"""The SFT job through torchrun on CPU ranks (gloo): learning, evaluation, checkpoints, export, and
the loss-scaling rule (the same losses on one rank as on two)."""

import json
import re

import pytest

from tests.jobs import read_metrics, run_to_end, torchrun, undocumented_metrics


@pytest.fixture(scope="module")
def sft_job(tmp_path_factory):
    from offline.arithmetic import ensure_arithmetic_assets, ensure_arithmetic_sft_data

    root = tmp_path_factory.mktemp("sft_assets")
    # The small arithmetic policy: a 2-layer model with a context for whole problems (the small
    # tiny policy's 64 tokens are too few for its finer tokenizer).
    policy = ensure_arithmetic_assets(root, small=True, log=lambda *_: None).model_dir
    data = ensure_arithmetic_sft_data(root, small=True, log=lambda *_: None)
    return [f"model.path={policy}", f"model.tokenizer_path={data / 'tokenizer'}",
            f"data.train_path={data / 'train.jsonl'}", f"data.eval_path={data / 'eval.jsonl'}",
            "data.max_length=160", "train.batch_size=8", "train.lr=3e-3", "train.schedule=constant",
            "train.max_tokens_per_device=640", "eval.max_new_tokens=6", "eval.generate_rows=6",
            "trainer.progress=false"]


def run_sft(overrides, run_dir, *extra, ranks=2, timeout=300):
    return run_to_end(torchrun("rl_core.train_sft", "sft_arithmetic.yaml", *overrides, f"trainer.run_dir={run_dir}",
                               *extra, ranks=ranks), timeout)


@pytest.mark.timeout(600)
def test_sft_learns_evaluates_checkpoints_and_exports(sft_job, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir = tmp_path / "sft"
    output = run_sft(sft_job, run_dir, "train.max_steps=12", "eval.every=6", "trainer.save_every=6",
                     "eval.reward_fn=rl_core.rewards.math:answer_reward")
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(13))
    evaluated = [r for r in rows if "eval/loss" in r]
    assert [r["step"] for r in evaluated] == [0, 6, 12]
    assert all(0.0 <= r["eval/accuracy"] <= 1.0 and 0.0 <= r["eval/token_accuracy"] <= 1.0 for r in evaluated)
    losses = [r["eval/loss"] for r in evaluated]
    assert losses[0] > losses[1] > losses[2] and losses[2] < 0.95 * losses[0], losses  # held-out loss falls
    assert rows[-1]["train/loss"] < rows[1]["train/loss"]
    assert all(r["train/tokens"] > 0 for r in rows[1:])
    assert undocumented_metrics(rows) == [], "add these to rl_core/metric_docs/"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000006", "step_00000012"]
    final = run_dir / "final"
    model = AutoModelForCausalLM.from_pretrained(final)
    assert AutoTokenizer.from_pretrained(final).chat_template  # the chat template travels with the model
    assert model.config.n_positions == 160
    assert "final model saved" in output and (run_dir / "config.yaml").is_file()


@pytest.fixture(scope="module")
def two_ranks(sft_job, tmp_path_factory):
    """6 padded steps on 2 ranks, checkpoints at 3 and 6, step 2 profiled: (run_dir, output). One launch
    serves as the reference of the rank, resume and packing tests, the checkpoints the resume and
    damaged-checkpoint tests copy, and the profile test's traces (profiling leaves the numbers as they are)."""
    run_dir = tmp_path_factory.mktemp("two_ranks") / "run"
    output = run_sft(sft_job, run_dir, "train.max_steps=6", "trainer.save_every=3", "trainer.profile_steps=[2]")
    return run_dir, output


@pytest.mark.timeout(900)
def test_one_rank_and_two_ranks_train_the_same_and_a_resumed_run_continues_exactly(sft_job, two_ranks, tmp_path):
    """The loss is the mean over the global batch's trained tokens whatever the split (each rank's
    token sum / global count x dp_size), so one rank and two follow the same losses; a run stopped
    after a checkpoint and resumed logs the same losses as one that was never stopped."""
    import shutil

    two, _ = two_ranks
    one = tmp_path / "one"
    run_sft(sft_job, one, "train.max_steps=6", ranks=1)
    two_losses = [r["train/loss"] for r in read_metrics(two) if "train/loss" in r]
    one_losses = [r["train/loss"] for r in read_metrics(one) if "train/loss" in r]
    assert len(two_losses) == 6 and two_losses == pytest.approx(one_losses, rel=1e-4, abs=1e-5)

    # A run stopped after its step-3 checkpoint, made by copying the shared run's checkpoint and rows
    # through step 3 (manifests hold relative paths) instead of launching a 3-step run.
    resumed = tmp_path / "resumed"
    shutil.copytree(two / "checkpoints" / "step_00000003", resumed / "checkpoints" / "step_00000003")
    (resumed / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in read_metrics(two) if r["step"] <= 3))
    output = run_sft(sft_job, resumed, "train.max_steps=6", "trainer.save_every=3", "trainer.resume=auto")
    assert f"resumed from {resumed / 'checkpoints' / 'step_00000003'} at step 3" in output
    rows = read_metrics(resumed)
    assert [r["step"] for r in rows] == list(range(7))  # each step logged once
    assert [r["train/loss"] for r in rows[4:]] == pytest.approx(two_losses[3:], rel=1e-5, abs=1e-6)  # the resumed steps


@pytest.mark.timeout(600)
def test_lora_trains_only_adapters_and_exports_the_adapter_or_the_merged_model(sft_job, tmp_path):
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    base_path = next(o.split("=", 1)[1] for o in sft_job if o.startswith("model.path="))
    lora = ["model.lora.rank=4", "model.lora.alpha=8", "train.max_steps=6", "train.lr=1e-2", "train.warmup_steps=0"]
    adapter_dir = tmp_path / "adapter"
    run_sft(sft_job, adapter_dir, *lora, "model.lora.export=adapter")
    # held-out rows, the same before and after (a step's train loss is its own batch's)
    heldout = [r["eval/loss"] for r in read_metrics(adapter_dir) if "eval/loss" in r]
    assert len(heldout) == 2 and heldout[-1] < heldout[0]
    adapter = load_file(adapter_dir / "final" / "adapter_model.safetensors")
    lora_b = [t for name, t in adapter.items() if "lora_B" in name]
    assert lora_b and all(t.abs().sum() > 0 for t in lora_b)  # B starts at zero: training moved it
    assert not (adapter_dir / "final" / "model.safetensors").exists()
    base = AutoModelForCausalLM.from_pretrained(base_path)
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path), adapter_dir / "final")

    merged_dir = tmp_path / "merged"
    run_sft(sft_job, merged_dir, *lora, "model.lora.export=merged")
    merged = AutoModelForCausalLM.from_pretrained(merged_dir / "final").eval()
    base_state, merged_state = base.state_dict(), merged.state_dict()
    changed = [name for name in base_state if not torch.equal(base_state[name], merged_state[name])]
    assert changed and all("c_attn" in name for name in changed)  # only the adapted layers (GPT-2 default)
    ids = torch.tensor([[5, 6, 7, 8]])
    # The same seed and data: the merged model is the base plus the same adapter.
    assert torch.allclose(merged(ids).logits, with_adapter.eval()(ids).logits, atol=1e-5)


@pytest.mark.timeout(600)
def test_packed_training_follows_the_padded_losses(sft_job, two_ranks, tmp_path):
    (padded, _), packed = two_ranks, tmp_path / "packed"  # the padded run is the shared one
    run_sft(sft_job, packed, "train.max_steps=6", "train.packing=true")
    padded_rows, packed_rows = read_metrics(padded)[1:], read_metrics(packed)[1:]
    assert len(packed_rows) == len(padded_rows) == 6
    assert [r["train/loss"] for r in packed_rows] == pytest.approx([r["train/loss"] for r in padded_rows], rel=1e-4)
    for packed_row, padded_row in zip(packed_rows, padded_rows):
        assert packed_row["perf/padding_fraction"] <= padded_row["perf/padding_fraction"]  # rows of like length here


@pytest.mark.timeout(600)
def test_the_arithmetic_recipe_policy_is_what_the_sft_job_exports(tmp_path):
    """The GRPO recipe's policy is built by this job (configs/sft_arithmetic.yaml run in one process):
    the same recipe through torchrun exports the same weights."""
    import torch
    from safetensors.torch import load_file

    from offline.arithmetic import (SMALL_SETTINGS, ensure_arithmetic_assets, ensure_arithmetic_sft_data,
                                         starting_policy)
    from offline.assets import ensure_tiny_assets

    root = tmp_path / "assets"
    built = ensure_arithmetic_assets(root, small=True, log=lambda *_: None).model_dir
    data = ensure_arithmetic_sft_data(root, small=True, log=lambda *_: None)
    start = starting_policy(SMALL_SETTINGS, ensure_tiny_assets(root, small=True).model_dir, tmp_path / "init")
    run_dir = tmp_path / "run"
    run_sft([f"model.path={start}", f"model.tokenizer_path={data / 'tokenizer'}",
             f"data.train_path={data / 'train.jsonl'}", "data.eval_path=null", "eval.every=0",
             "trainer.progress=false", *SMALL_SETTINGS.sft_overrides], run_dir, ranks=1)
    exported, shipped = load_file(run_dir / "final" / "model.safetensors"), load_file(built / "model.safetensors")
    initial = load_file(start / "model.safetensors")
    assert exported.keys() == shipped.keys()
    for name, tensor in shipped.items():
        torch.testing.assert_close(exported[name], tensor, rtol=1e-5, atol=1e-5, msg=name)
    assert any(not torch.equal(initial[name], tensor) for name, tensor in shipped.items())  # it trained
    recorded = json.loads((built / "build.json").read_text())["settings"]["sft_recipe"]["train"]
    assert recorded["max_steps"] == 10 and recorded["schedule"] == "constant"


@pytest.mark.timeout(600)
def test_a_damaged_checkpoint_is_skipped_on_auto_and_refused_by_name_with_one_line(sft_job, two_ranks, tmp_path):
    import shutil
    import subprocess

    # The shared run's checkpoints (steps 3 and 6) and rows, copied rather than made by a launch of
    # their own; the copy's newest checkpoint is the one damaged.
    shared, _ = two_ranks
    run_dir = tmp_path / "run"
    shutil.copytree(shared / "checkpoints", run_dir / "checkpoints")
    shutil.copy(shared / "metrics.jsonl", run_dir / "metrics.jsonl")
    newest = run_dir / "checkpoints" / "step_00000006"
    shard = sorted(newest.rglob("*.distcp"))[-1]
    written = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: written // 2])  # an interrupted copy, say

    argv = torchrun("rl_core.train_sft", "sft_arithmetic.yaml", *sft_job, f"trainer.run_dir={run_dir}",
                    "train.max_steps=6", "eval.every=0", f"trainer.resume={newest}")
    refused = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    errors = [line for line in refused.stderr.splitlines() if line.startswith("[rank") and "error:" in line]
    assert refused.returncode != 0 and errors == [
        f"[rank 0] error: trainer.resume={newest}: the checkpoint is damaged: {shard} has {shard.stat().st_size} "
        f"bytes, {written} were written; resume from another one (or 'auto', which takes the "
        "newest one that verifies)"], refused.stderr[-3000:]
    # No traceback of ours: torchrun's own summary is all that follows the line.
    assert not re.search(r'File "[^"]*/(rl_core|workers|envs)/', refused.stderr), refused.stderr[-3000:]

    output = run_sft(sft_job, run_dir, "train.max_steps=6", "eval.every=0", "trainer.resume=auto")
    assert output.count("skipping checkpoint") == 1 and f"skipping checkpoint {newest}: {shard} has" in output
    assert f"resumed from {run_dir / 'checkpoints' / 'step_00000003'} at step 3" in output
    assert "metrics.jsonl: dropped 3 rows logged after step 3" in output
    assert [r["step"] for r in read_metrics(run_dir) if "train/loss" in r] == [1, 2, 3, 4, 5, 6]  # 4 to 6 trained again


@pytest.mark.timeout(600)
def test_profile_steps_trace_the_listed_steps_on_each_rank_and_steps_beyond_the_data_stop(sft_job, two_ranks,
                                                                                            tmp_path):
    import subprocess

    run_dir, output = two_ranks  # the shared 2-rank run profiles step 2
    profile = run_dir / "profile"
    assert sorted(p.relative_to(profile).as_posix() for p in profile.rglob("*.json")) == [
        "step_2/rank0.pt.trace.json", "step_2/rank1.pt.trace.json"]
    for rank in (0, 1):
        path = profile / "step_2" / f"rank{rank}.pt.trace.json"
        assert f"[rank {rank}] profile of step 2: {path}\n" in output
        events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
        step = next(e for e in events if e["name"] == "train step")
        inside = [e for e in events if step["ts"] <= e["ts"] and e["ts"] + e["dur"] <= step["ts"] + step["dur"] + 1]
        assert any(e["name"].startswith("aten::") for e in inside) and any("FSDP::" in e["name"] for e in inside)
        assert any(e["name"] == "Optimizer.step#AdamW.step" for e in inside), sorted({e["name"] for e in inside})
    # The run's length comes from the data: a step beyond it stops with one line once the rows are read.
    argv = torchrun("rl_core.train_sft", "sft_arithmetic.yaml", *sft_job, f"trainer.run_dir={tmp_path / 'refused'}",
                    "train.max_steps=3", "trainer.profile_steps=[2,4]", ranks=1)
    refused = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    errors = [line for line in refused.stderr.splitlines() if line.startswith("[rank") and "error:" in line]
    assert refused.returncode != 0 and len(errors) == 1, refused.stderr[-3000:]
    assert re.fullmatch(r"\[rank 0\] error: trainer.profile_steps=\[2, 4\] names step\(s\) \[4\] outside 1\.\.3, the "
                        r"run's steps \(\d+ usable rows of \S+ / train.batch_size=8 x train.epochs=\d+, "
                        r"train.max_steps=3\); list steps of the run, e.g. trainer.profile_steps=\[3,4\]", errors[0]), \
        errors[0]
    assert not re.search(r'File "[^"]*/(rl_core|workers|envs)/', refused.stderr), refused.stderr[-3000:]


@pytest.mark.timeout(900)
def test_sigterm_mid_step_stops_within_seconds_and_resume_continues_then_says_nothing_is_left(sft_job, tmp_path):
    """Issue 35 for the jobs on fixed data (they share run_main with PPO): rank 1 holds at step 3's start
    while rank 0 goes into the step and waits for it inside the sharded model's collectives; SIGTERM to
    torchrun then ends both within 10 s with one line, and `resume=auto` continues from step 2. Resuming
    the finished run says so in one line and exits 0 before loading the model."""
    import os
    import signal
    import time

    from rl_core.stop_signal import TEST_HOLD_ENV
    from tests.ppo.test_reliability import OUR_TRACEBACK, Job

    run_dir = tmp_path / "run"
    common = ["train.max_steps=6", "trainer.save_every=1", "eval.every=0"]
    job = Job({"overrides": sft_job}, run_dir, *common, config="sft_arithmetic.yaml", module="rl_core.train_sft",
              env={TEST_HOLD_ENV: "1:3:update:120"})
    try:
        began = job.wait_for_line("test hold: step 3 (update)", 300)
        time.sleep(max(0.0, began + 1.5 - time.monotonic()))  # rank 0 is inside step 3's collectives by then
        job.tree.scan()
        sent = time.monotonic()
        os.kill(job.proc.pid, signal.SIGTERM)
        code = job.wait(60)
        exited = time.monotonic() - sent
        gone = exited + job.tree.wait_all_gone(max(0.5, 10.0 - exited))
    finally:
        job.abort()
    stopped = [line for _, line in job.lines if "stopped by" in line]
    assert code != 0 and len(stopped) == 1, job.output[-4000:]
    assert re.fullmatch(r"\[rank 0\] stopped by SIGTERM at step 3 \(update\); (its clean-up took over \d+ s, so it "
                        r"was cut short; )?trainer.resume=auto continues from the last checkpoint", stopped[0]), stopped
    assert not OUR_TRACEBACK.search(job.output), job.output[-4000:]
    print(f"\nSFT: torchrun exited {exited:.1f}s after SIGTERM, every process gone at {gone:.1f}s: '{stopped[0]}'")
    assert exited < 10.0 and gone < 10.0

    output = run_sft(sft_job, run_dir, *common, "trainer.resume=auto")
    assert f"resumed from {run_dir / 'checkpoints' / 'step_00000002'} at step 2" in output
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(7))  # each step once (step 0: the evaluation)

    final_written = (run_dir / "final" / "config.json").stat().st_mtime_ns
    rows = (run_dir / "metrics.jsonl").read_text()
    started = time.monotonic()
    output = run_sft(sft_job, run_dir, *common, "trainer.resume=auto")
    took = time.monotonic() - started
    said = [line for line in output.splitlines() if "nothing left to train" in line]
    assert len(said) == 1 and re.fullmatch(
        rf"nothing left to train: {re.escape(str(run_dir / 'checkpoints' / 'step_00000006'))} is at step 6, the last "
        rf"one \(train.epochs=4 of \d+ steps, train.max_steps=6\), and {re.escape(str(run_dir / 'final'))} holds the "
        r"model; raise train.epochs or train.max_steps to train on, or give a new trainer.run_dir", said[0]), output[-3000:]
    assert "[sft]" not in output  # the model was never loaded, nor the logger opened
    assert (run_dir / "final" / "config.json").stat().st_mtime_ns == final_written  # final/ is not rewritten
    assert (run_dir / "metrics.jsonl").read_text() == rows
    print(f"finished run resumed: '{said[0]}' ({took:.1f}s)")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("on_error", ["stop", "continue"])
def test_a_checkpoint_that_cannot_be_written_stops_or_with_continue_is_said_and_training_goes_on(sft_job, tmp_path,
                                                                                              on_error):
    """The checkpoints' directory on a real 256 KiB tmpfs: every save fails with ENOSPC (metrics and the
    export go to the run directory, on the ordinary disk)."""
    import shutil
    import subprocess

    run_dir = tmp_path / "run"
    disk = run_dir / "checkpoints"
    disk.mkdir(parents=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    try:
        argv = torchrun("rl_core.train_sft", "sft_arithmetic.yaml", *sft_job, f"trainer.run_dir={run_dir}",
                        "train.max_steps=4", "trainer.save_every=2", "eval.every=0",
                        f"trainer.on_checkpoint_error={on_error}")
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        output = done.stdout + done.stderr
        # rank 0's own line (torchrun's summary repeats it after "traceback :")
        failed = [line for line in output.splitlines()
                  if line.startswith(("[rank 0] error: checkpoint", "checkpoint step_")) and "could not be written" in line]
        leftovers = sorted(p.name for p in disk.iterdir())
    finally:
        subprocess.run(["umount", str(disk)], check=True)
    rows = read_metrics(run_dir)
    if on_error == "stop":
        assert done.returncode != 0 and len(failed) == 1, output[-3000:]
        assert failed[0].startswith(f"[rank 0] error: checkpoint step_00000002 could not be written to {disk}: "
                                    "No space left on device [ENOSPC]"), failed[0]
        assert failed[0].endswith("trainer.on_checkpoint_error=continue to train on without checkpoints that fail)")
        assert [r["step"] for r in rows] == [0, 1, 2]
    else:
        assert done.returncode == 0, output[-3000:]
        assert [line.split(" could not")[0] for line in failed] == ["checkpoint step_00000002", "checkpoint step_00000004"]
        assert all("No space left on device [ENOSPC]" in line and "the partial checkpoint was removed. Training goes "
                   "on without it (trainer.on_checkpoint_error=continue)" in line for line in failed), failed
        assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
        assert [r.get("checkpoint/failed") for r in rows] == [None, None, None, 1, 1]  # the rows after a failure
        assert (run_dir / "final" / "config.json").is_file()  # trained to the end and exported
    assert leftovers == []  # no partial checkpoint left on the full disk
    shutil.rmtree(run_dir, ignore_errors=True)
