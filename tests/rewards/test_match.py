"""The exact-answer reward (rl_core/rewards/match.py): one word or number, case and a final full stop aside."""

import pytest

from rl_core.rewards import load_reward_fn
from rl_core.rewards.match import exact_answer


@pytest.mark.parametrize("completion, answer, expected", [
    ("red", "red", 1.0),
    (" Red.", "red", 1.0),          # the space after "Assistant:", a capital, a full stop
    ("3", "3", 1.0),
    ("3\n", "3", 1.0),
    ("blue", "red", 0.0),
    ("red and blue", "red", 0.0),   # more than the answer is not the answer
    ("redd", "red", 0.0),
    ("", "", 0.0),                  # an empty completion never scores
    ("2", "3", 0.0),
])
def test_only_the_answer_itself_scores(completion, answer, expected):
    assert exact_answer([completion], [{"answer": answer}]) == [expected]


def test_it_scores_a_batch_and_loads_by_import_path():
    fn = load_reward_fn("rl_core.rewards.match:exact_answer")
    assert getattr(fn, "scores_batches", False)
    rows = [{"answer": "green"}, {"answer": "4"}, {"label": "Square"}]
    assert exact_answer(["Green", "four", "square"], rows[:2] + [{"answer": "x", "label": "Square"}],
                        answer_key="answer") == [1.0, 0.0, 0.0]
    assert exact_answer(["square."], [rows[2]], answer_key="label") == [1.0]
