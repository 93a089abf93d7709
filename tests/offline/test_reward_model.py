"""The tiny sentiment reward model: offline labels cut at a period, ties left out, built once and cached."""

import json
import re

import pytest


# Every phase of a first run that takes minutes on a CPU with the real assets shows a bar with an ETA.
FIRST_RUN_BARS = ("pretraining the tiny policy", "sampling train continuations", "labelling train pairs",
                  "sampling test continuations", "labelling test pairs", "sampling to normalise before training",
                  "training the reward model", "sampling to normalise after training",
                  "sampling to check on fresh samples")


@pytest.mark.timeout(200)
def test_tiny_reward_model_is_built_once_and_cached_and_shows_progress(tmp_path, capsys):
    from offline.assets import ensure_tiny_assets
    from offline.reward_model import ensure_tiny_reward_model
    from workers.loading import load_reward_model

    paths = ensure_tiny_assets(tmp_path, small=True, log=lambda *_: None)
    logged: list[str] = []
    first = ensure_tiny_reward_model(paths, log=logged.append)
    shown = capsys.readouterr().err
    for phase in FIRST_RUN_BARS:
        bar = re.search(re.escape(phase) + r".*?100%\|.*?\| (\d+)/\1 \[[\d:]+<[\d:]+", shown)
        assert bar, (phase, shown[-2000:])  # a finished bar: elapsed<remaining, tqdm's ETA field
    assert len(logged) == 1 and "reward model" in logged[0]
    facts = json.loads((first / "build.json").read_text())
    assert 0.0 <= facts["heldout_accuracy"] <= 1.0
    assert (paths.root / "preferences" / "sentiment_train.jsonl").stat().st_size > 0
    model = load_reward_model(str(first))
    assert model.config.num_labels == 1 and model.config.reward_gain != 1.0
    stamp = (first / "build.json").stat().st_mtime_ns
    assert ensure_tiny_reward_model(paths, log=logged.append) == first
    assert len(logged) == 1 and (first / "build.json").stat().st_mtime_ns == stamp
    assert "[train_rm]" not in capsys.readouterr().err  # cached: nothing is built, no bar is drawn


def test_labelled_pairs_keep_samples_with_a_period_and_cut_there():
    from offline.reward_model import TinyRMSettings, _labelled_pairs

    dot = 9
    settings = TinyRMSettings(group_size=3, truncate_after=2)
    responses = [
        [5, 6, 7, dot, 8], [5, dot, 6, 7, 8], [4, 4, dot, 3, dot], [3, 3, 3, dot, 1],  # query 0: 3 kept
        [5, 5, dot, 1, 1], [6, 6, 6, 6, 6], [7, 7, 7, dot, 7], [8, 8, 8, 8, dot],  # query 1: 3 kept
    ]
    every = _labelled_pairs([[1], [2]], responses, 4, settings, dot, every_pair=True)
    assert [index for index, _, _ in every] == [0, 0, 0, 1, 1, 1], "all 3 pairs among 3 kept samples"
    assert (0, [5, 6, 7, dot], [4, 4, dot]) in every, "cut through the first period at/after index 2"
    disjoint = _labelled_pairs([[1], [2]], responses, 4, settings, dot, every_pair=False)
    assert disjoint == [(0, [5, 6, 7, dot], [4, 4, dot]), (1, [5, 5, dot], [7, 7, 7, dot])]


def test_written_pairs_leave_out_ties_and_follow_the_labeler(tmp_path):
    from offline.labeler import get_labeler
    from offline.reward_model import _write_pairs as write_labelled

    pairs = [(0, " He was very sad and hurt.", " He was so happy and proud."),
             (0, " He sat down.", " He walked on."),  # both neutral: a tie, left out
             (1, " What a wonderful day.", " What a terrible day."),
             (1, "  ", " What a terrible day.")]  # nothing to judge on one side: left out
    counts = write_labelled(tmp_path / "p.jsonl", ["q0", "q1"], pairs, get_labeler("sentiment"))
    assert counts == {"written": 2, "ties": 1, "empty": 1}
    rows = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert [(r["prompt"], r["chosen"]) for r in rows] == [("q0", " He was so happy and proud."),
                                                          ("q1", " What a wonderful day.")]
