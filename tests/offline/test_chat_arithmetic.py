"""The released-model recipe's questions (offline/chat_arithmetic.py): two-digit sums and differences, the held-out
ones never trained on, and the same held-out pairs in other words."""

import json

from offline.chat_arithmetic import ChatArithmeticSettings, build_rows, ensure_chat_arithmetic


def _question(row):
    return row["messages"][0]["content"]


def test_questions_are_two_digit_sums_and_differences_with_right_answers_and_unseen_eval_pairs():
    settings = ChatArithmeticSettings()
    rows = build_rows(settings)
    train, held_out, phrased = rows["train.jsonl"], rows["eval.jsonl"], rows["phrasings.jsonl"]
    assert (len(train), len(held_out), len(phrased)) == (settings.train_questions, settings.eval_questions,
                                                         settings.eval_questions)
    for row in train + held_out:
        a, op, b = _question(row).removeprefix("What is ").removesuffix("?").split()
        assert 10 <= int(a) <= 99 and 10 <= int(b) <= 99
        assert int(row["answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b)) >= 0
    assert {_question(r) for r in train}.isdisjoint(_question(r) for r in held_out)
    subtractions = sum("-" in _question(r) for r in held_out)
    assert 0.3 * len(held_out) < subtractions < 0.7 * len(held_out)
    # The other phrasings ask the held-out pairs again, in other words, with the same answers.
    assert [r["answer"] for r in phrased] == [r["answer"] for r in held_out]
    assert not any(_question(r).startswith("What is") for r in phrased)
    assert len({_question(r).split()[0] for r in phrased}) >= 3


def test_files_are_written_once_and_rewritten_when_stale(tmp_path):
    lines = []
    paths = ensure_chat_arithmetic(tmp_path, log=lines.append)
    assert len(lines) == 1 and paths.eval_file.is_file() and paths.phrasings_file.is_file()
    ensure_chat_arithmetic(tmp_path, log=lines.append)
    assert len(lines) == 1  # found as built
    (paths.data_dir / "build.json").write_text(json.dumps({"settings": {"seed": 0}}))
    ensure_chat_arithmetic(tmp_path, log=lines.append)
    assert len(lines) == 2 and json.loads(paths.train_file.read_text().splitlines()[0])["answer"]
