"""The multi-turn calculator env: safe arithmetic, append vs fresh state, answers and budgets."""

import asyncio

import pytest

from envs.base import Action
from envs.calculator import CalculatorEnv, format_number, safe_eval


def act(text: str) -> Action:
    return Action(text=text, token_ids=[])



@pytest.mark.parametrize("expression", ["2+3", "12*7+3", "-4 + 10 // 3", "2**10 - 1", "7/2", "(1+2)*(3-5) % 5"])
def test_safe_eval_matches_python_arithmetic(expression):
    assert safe_eval(expression) == eval(expression, {"__builtins__": {}})  # reference only, on trusted input


@pytest.mark.parametrize("expression", ["__import__('os').system('true')", "x + 1", "abs(-3)", "2**1000",
                                        "1/0", "[1, 2]", "2 +", "'a' * 3"])
def test_safe_eval_refuses_anything_but_arithmetic(expression):
    with pytest.raises(ValueError):
        safe_eval(expression)


def test_format_number():
    assert format_number(safe_eval("6/3")) == "2"
    assert format_number(safe_eval("7/2")) == "3.5"


def test_calculator_append_then_fresh_state_then_correct_answer():
    env = CalculatorEnv(max_turns=5, summarize_every=2)
    state0 = asyncio.run(env.reset({"expression": "12*7+3"}))
    assert "12*7+3" in state0

    a1 = "Let me see <calc>12*7</calc>"
    r1 = asyncio.run(env.step(act(a1)))
    assert not r1.done and r1.reward == 0.0
    assert r1.observation.startswith(state0 + a1) and r1.observation.endswith("<result>84</result>\n")

    a2 = " then <calc>84+3</calc>"
    r2 = asyncio.run(env.step(act(a2)))  # second tool call: a summary, not an extension
    assert not r2.observation.startswith(r1.observation + a2)
    assert r2.observation.startswith(state0) and "12*7=84" in r2.observation and "84+3=87" in r2.observation

    r3 = asyncio.run(env.step(act("<answer>87</answer>")))
    assert r3.done and r3.reward == 1.0 and r3.observation is None and r3.info["correct"]


def test_calculator_wrong_answer_nudge_budget_and_max_turns():
    env = CalculatorEnv(max_turns=3, summarize_every=0, nudge="?")
    state0 = asyncio.run(env.reset({"expression": "2+3"}))
    r1 = asyncio.run(env.step(act("hmm")))  # no tag: the nudge is appended
    assert r1.observation == state0 + "hmm?" and not r1.done
    env = CalculatorEnv(max_turns=3, summarize_every=0, max_state_chars=len(state0) + 10, nudge="?")
    asyncio.run(env.reset({"expression": "2+3"}))
    r = asyncio.run(env.step(act("a long rambling action text")))  # would pass the budget: fresh summary
    assert not r.observation.startswith(state0 + "a long") and r.observation.startswith(state0)
    r = asyncio.run(env.step(act("<calc>2+3</calc>")))
    r = asyncio.run(env.step(act("still thinking")))  # third action: out of turns
    assert r.done and r.reward == 0.0 and r.info["out_of_turns"]
    asyncio.run(env.reset({"expression": "2+3"}))
    wrong = asyncio.run(env.step(act("<answer>6</answer>")))
    assert wrong.done and wrong.reward == 0.0


def test_calculator_is_deterministic_and_resets_state():
    actions = ["<calc>1+1</calc>", "x", "<calc>2*2</calc>", "<answer>4</answer>"]

    def play(env):
        out = [asyncio.run(env.reset({"expression": "2*2"}))]
        for a in actions:
            r = asyncio.run(env.step(act(a)))
            out.append((r.observation, r.reward, r.done))
        return out

    env = CalculatorEnv(max_turns=6)
    first = play(env)
    assert play(env) == first == play(CalculatorEnv(max_turns=6))
    assert first[-1][1:] == (1.0, True)
