"""Checkpoint retention: trainer.keep_last complete checkpoints stay, older ones go, partial ones never count."""

from pathlib import Path

import pytest

from rl_core.checkpoint import Checkpointer


def make_checkpoints(root, steps, partial=()):
    for step in steps:
        (root / f"step_{step:08d}").mkdir(parents=True)
        (root / f"step_{step:08d}" / "trainer_state.json").write_text("{}")
    for step in partial:
        (root / f"step_{step:08d}.tmp").mkdir(parents=True)


@pytest.mark.parametrize("keep_last, kept", [(2, [9, 10]), (1, [10]), (0, [1, 2, 9, 10])])
def test_only_the_newest_keep_last_checkpoints_stay_and_nothing_partial(tmp_path, keep_last, kept):
    # Left by a run stopped mid-delete (step 0, renamed before its removal) and one killed mid-save (step 11).
    make_checkpoints(tmp_path, [1, 2, 9, 10], partial=[0, 11])
    (tmp_path / "step_00000011.tmp" / "model").mkdir()
    checkpointer = Checkpointer(tmp_path, rank=0, keep_last=keep_last)
    checkpointer._prune()  # what rank 0 does once this save (step 10) is complete
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"step_{step:08d}" for step in kept]


def test_keep_last_must_not_be_negative(tmp_path):
    with pytest.raises(ValueError, match="keep_last"):
        Checkpointer(tmp_path, rank=0, keep_last=-1)


def test_resuming_on_another_world_size_says_so_and_what_carries_over(tmp_path, capsys):
    import json
    import random

    import numpy as np
    import torch

    checkpoint = tmp_path / "step_00000003"
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text(json.dumps({"step": 3, "prompts": {"epoch": 0}}))
    rng = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(), "cuda": None}
    for rank in (0, 1):  # written by 2 ranks; this process resumes it alone (no process group: 1 rank)
        torch.save(rng, checkpoint / f"rng_rank{rank}.pt")
    step, state = Checkpointer(tmp_path, rank=0).maybe_resume("auto", {})
    assert (step, state) == (3, {"prompts": {"epoch": 0}})
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith(f"resumed from {checkpoint} at step 3, written by 2 ranks, on 1 now: "), line
    assert "data order" in line and "optimizer" in line, line


def test_resuming_on_the_same_world_size_says_nothing_more(tmp_path, capsys):
    make_checkpoints(tmp_path, [2])
    (tmp_path / "step_00000002" / "trainer_state.json").write_text('{"step": 2}')
    assert Checkpointer(tmp_path, rank=0).maybe_resume("auto", {}) == (2, {})
    assert capsys.readouterr().out.splitlines() == [f"resumed from {tmp_path / 'step_00000002'} at step 2"]


def test_an_export_stopped_midway_leaves_no_final_directory_and_a_whole_one_replaces_the_old(tmp_path):
    from rl_core.staging import staged_directory

    final = tmp_path / "final"
    with pytest.raises(KeyboardInterrupt):  # a stop signal while the weights are being written
        with staged_directory(final) as staging:
            (staging / "config.json").write_text("{}")
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []  # no final/ that a resume would take for a finished export

    (tmp_path / ".final.building-1").mkdir()  # what a killed export left
    (tmp_path / ".final.building-1" / "partial.safetensors").write_text("x")
    final.mkdir()
    (final / "old.safetensors").write_text("old")  # an earlier export of a run trained further since
    with staged_directory(final) as staging:
        (staging / "model.safetensors").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]
    assert [p.name for p in final.iterdir()] == ["model.safetensors"]


def test_the_reward_model_export_is_atomic_as_every_job_s(tmp_path, tiny_model_dir):
    from rl_core.distributed import DataParallel
    from rl_core.reward_model.training import export_reward_model
    from workers.loading import init_reward_model, load_tokenizer

    tokenizer = load_tokenizer(str(tiny_model_dir))
    model = init_reward_model(str(tiny_model_dir), pad_token_id=tokenizer.pad_token_id, seed=0)
    out = tmp_path / "reward_model"
    out.mkdir()
    (out / "old.safetensors").write_text("old")  # an earlier export

    class Stopped:  # a stop signal after the first file is written
        config = model.config

        def save_pretrained(self, path):
            (Path(path) / "model.safetensors").write_text("partial")
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # a stop signal while the weights are being written
        export_reward_model(Stopped(), tokenizer, out, DataParallel())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["reward_model"]
    assert [p.name for p in out.iterdir()] == ["old.safetensors"]  # the earlier export, as it was
    export_reward_model(model, tokenizer, out, DataParallel())
    assert (out / "config.json").is_file() and not (out / "old.safetensors").exists()
