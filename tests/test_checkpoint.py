"""Checkpoint retention: trainer.keep_last complete checkpoints stay, older ones go, partial ones never count."""

import pytest

from rl_core.checkpoint import Checkpointer


def make_checkpoints(root, steps, partial=()):
    for step in steps:
        (root / f"step_{step:08d}").mkdir(parents=True)
        (root / f"step_{step:08d}" / "trainer_state.json").write_text("{}")
    for step in partial:
        (root / f"step_{step:08d}.tmp").mkdir(parents=True)


@pytest.mark.parametrize("keep_last, kept", [(2, [9, 10]), (1, [10]), (0, [1, 2, 9, 10])])
def test_only_the_newest_keep_last_checkpoints_stay(tmp_path, keep_last, kept):
    make_checkpoints(tmp_path, [1, 2, 9, 10], partial=[11])
    checkpointer = Checkpointer(tmp_path, rank=0, keep_last=keep_last)
    checkpointer._prune()
    assert [int(p.name[5:]) for p in checkpointer.complete()] == kept
    assert (tmp_path / "step_00000011.tmp").is_dir()  # a save in progress is not touched


def test_keep_last_must_not_be_negative(tmp_path):
    with pytest.raises(ValueError, match="keep_last"):
        Checkpointer(tmp_path, rank=0, keep_last=-1)
