"""The arithmetic recipe's problems: right references, the annotator's slip only where asked, chat rendering."""

import random
import re

import pytest
from transformers import AutoTokenizer

from rl_core.rewards.math import answer_reward
from offline.arithmetic import CHAT_TEMPLATE, make_problem, make_problems


@pytest.fixture
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _operands(problem):
    work = problem["solution"].splitlines()[0]
    a, op, b, _, result = re.fullmatch(r"(\d+) ([+-]) (\d+) (=) (\d+)", work).groups()
    return int(a), op, int(b), int(result)


def test_references_and_worked_lines_are_right_and_the_operations_are_mixed():
    problems = make_problems(400, seed=7, max_operand=10, sub_frac=0.5)
    ops = []
    for problem in problems:
        a, op, b, result = _operands(problem)
        assert result == (a + b if op == "+" else a - b) == int(problem["answer"])
        assert a >= b or op == "+"  # nobody gives away more than they have
        assert ("gives" in problem["messages"][0]["content"]) == (op == "-")
        assert answer_reward(problem["solution"], problem) == 1.0  # no slip asked for: every solution is right
        ops.append(op)
    assert 0.4 < ops.count("-") / len(ops) < 0.6


def test_the_annotators_slip_repeats_the_amount_given_away_on_subtractions_only():
    problems = make_problems(400, seed=7, max_operand=10, sub_frac=0.5, slip_frac=1.0)
    for problem in problems:
        a, op, b, result = _operands(problem)
        final = int(problem["solution"].rsplit("#### ", 1)[1])
        if op == "+":
            assert final == result
        else:
            assert final == b and result == a - b  # the sum is done right; the final line is wrong
            assert answer_reward(problem["solution"], problem) == float(a - b == b)


def test_problems_are_seeded():
    assert make_problems(20, 3, 10, 0.5, 0.7) == make_problems(20, 3, 10, 0.5, 0.7)
    assert make_problems(20, 3, 10, 0.5) != make_problems(20, 4, 10, 0.5)
    assert make_problem(random.Random(0), 10)["messages"][0]["role"] == "user"


def test_the_chat_template_renders_a_readable_generation_prompt(tokenizer):
    tokenizer.chat_template = CHAT_TEMPLATE
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Ann has 3 cups."}]
    rendered = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert rendered == "Be brief.\nUser: Ann has 3 cups.\nAssistant:"
    answered = tokenizer.apply_chat_template(chat + [{"role": "assistant", "content": "3"}], tokenize=False)
    assert answered.endswith(f"Assistant: 3{tokenizer.eos_token}\n")
