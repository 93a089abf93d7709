"""Checkpoints are verified before they are trusted, and a failed write leaves nothing half-written.

A one-rank process group (gloo) and the real sharded model, optimizer and torch.distributed.checkpoint
writer: a damaged shard or a missing trainer state is found by the manifest, `resume=auto` falls back
to the newest checkpoint that verifies and says which it skipped, an explicit `resume=PATH` stops with
one line naming the file, and a write to a full disk (a real 256 KiB tmpfs) stops with one line, the
partial checkpoint removed and the older ones untouched.
"""

import os
import shutil
import subprocess

import pytest
import torch

from rl_core.checkpoint import MANIFEST, Checkpointer, CheckpointError


@pytest.fixture(scope="module")
def process_group():
    import torch.distributed as dist

    from rl_core.distributed import init_distributed

    keys = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    saved = {key: os.environ.pop(key) for key in keys if key in os.environ}
    init_distributed(timeout_s=60)
    try:
        yield
    finally:
        dist.destroy_process_group()
        for key in keys:
            os.environ.pop(key, None)
        os.environ.update(saved)


def trainable(model_dir, seed):
    from workers.fsdp import shard_model
    from workers.trainable import TrainableModel
    from workers.loading import load_causal_lm

    torch.manual_seed(seed)
    model = load_causal_lm(model_dir)
    with torch.no_grad():  # different weights per seed, so a resume shows which checkpoint it loaded
        for param in model.parameters():
            param.add_(torch.randn(param.shape) * 0.01 * seed)
    model = shard_model(model)
    return TrainableModel(model, build_optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3))


def first_weight(trainable_model) -> torch.Tensor:
    from workers.fsdp import full_state_dict

    state = full_state_dict(trainable_model.model)
    return next(iter(state.values())).clone()


@pytest.fixture
def two_checkpoints(process_group, tiny_model_dir, tmp_path):
    """Checkpoints at steps 1 and 2 of two different models; returns (checkpointer, weights at 1, at 2)."""
    checkpointer = Checkpointer(tmp_path / "checkpoints", rank=0)
    weights = {}
    for step in (1, 2):
        model = trainable(tiny_model_dir, seed=step)
        checkpointer.save(step, {"policy": model}, {"note": step})
        weights[step] = first_weight(model)
    assert not torch.equal(weights[1], weights[2])
    return checkpointer, weights


def resume(checkpointer, mode, tiny_model_dir):
    model = trainable(tiny_model_dir, seed=7)
    step, state = checkpointer.maybe_resume(mode, {"policy": model})
    return step, state, first_weight(model)


@pytest.mark.timeout(120)
def test_every_checkpoint_lists_its_files_and_resumes_from_the_newest(two_checkpoints, tiny_model_dir):
    checkpointer, weights = two_checkpoints
    newest = checkpointer.complete()[-1]
    listed = (newest / MANIFEST).read_text()
    assert "trainer_state.json" in listed and "rng_rank0.pt" in listed and ".distcp" in listed
    step, state, weight = resume(checkpointer, "auto", tiny_model_dir)
    assert (step, state) == (2, {"note": 2}) and torch.equal(weight, weights[2])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("damage", ["truncate a shard", "remove the trainer state"])
def test_a_damaged_checkpoint_is_skipped_by_auto_and_refused_by_name(two_checkpoints, tiny_model_dir, capsys,
                                                                     damage):
    checkpointer, weights = two_checkpoints
    newest = checkpointer.complete()[-1]
    if damage == "truncate a shard":
        victim = next(newest.rglob("*.distcp"))
        victim.write_bytes(victim.read_bytes()[:100])
    else:
        victim = newest / "trainer_state.json"
        victim.unlink()
    step, state, weight = resume(checkpointer, "auto", tiny_model_dir)
    assert (step, state) == (1, {"note": 1}) and torch.equal(weight, weights[1])
    skipped = [line for line in capsys.readouterr().out.splitlines() if line.startswith("skipping")]
    problem = "has 100 bytes, " if damage == "truncate a shard" else "is missing"
    assert len(skipped) == 1 and skipped[0].startswith(f"skipping checkpoint {newest}: {victim} {problem}"), skipped
    with pytest.raises(CheckpointError, match=f"trainer.resume={newest}: the checkpoint is damaged: {victim}"):
        resume(checkpointer, str(newest), tiny_model_dir)


@pytest.fixture
def disk(tmp_path):
    """A real 256 KiB tmpfs: a disk that fills up after a few kilobytes of checkpoint."""
    disk = tmp_path / "small_disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)
        shutil.rmtree(disk, ignore_errors=True)


@pytest.mark.timeout(120)
def test_a_full_disk_stops_the_save_with_one_line_and_removes_the_partial_checkpoint(process_group, tiny_model_dir,
                                                                                  disk):
    checkpointer = Checkpointer(disk / "checkpoints", rank=0)
    (disk / "checkpoints").mkdir()
    older = disk / "checkpoints" / "step_00000001"
    older.mkdir()
    (older / "trainer_state.json").write_text('{"step": 1}')  # a small older checkpoint to keep
    with pytest.raises(CheckpointError) as failed:
        checkpointer.save(2, {"policy": trainable(tiny_model_dir, seed=2)}, {})
    line = str(failed.value)
    assert "\n" not in line and "No space left on device [ENOSPC]" in line, line
    assert f"checkpoint step_00000002 could not be written to {disk / 'checkpoints'}" in line
    assert "the partial checkpoint was removed; 1 older checkpoints are untouched" in line
    assert sorted(p.name for p in (disk / "checkpoints").iterdir()) == ["step_00000001"]
    assert (older / "trainer_state.json").read_text() == '{"step": 1}'


@pytest.mark.timeout(120)
def test_with_on_error_continue_a_full_disk_is_one_line_and_the_job_goes_on(process_group, tiny_model_dir, disk,
                                                                            capsys):
    checkpointer = Checkpointer(disk / "checkpoints", rank=0, on_error="continue")
    older = disk / "checkpoints" / "step_00000001"
    older.mkdir(parents=True)
    (older / "trainer_state.json").write_text('{"step": 1}')
    assert checkpointer.save(2, {"policy": trainable(tiny_model_dir, seed=2)}, {}) is None
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and "No space left on device [ENOSPC]" in lines[0], lines
    assert lines[0].startswith(f"checkpoint step_00000002 could not be written to {disk / 'checkpoints'}")
    assert "1 older checkpoints are untouched. Training goes on without it (trainer.on_checkpoint_error=" \
           "continue)" in lines[0]
    assert sorted(p.name for p in (disk / "checkpoints").iterdir()) == ["step_00000001"]
    assert (older / "trainer_state.json").read_text() == '{"step": 1}'
