"""Reward functions: the shipped math checker and format reward on tricky answers, and the runner
(sync and async functions, weights, timeouts, failures)."""

import asyncio
import time

import pytest

from rl_core.rewards import RewardFnError, RewardFunctions, batched, load_reward_fn
from rl_core.rewards.math import answer_reward, format_reward, last_number_reward

GSM8K_SOLUTION = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72"


@pytest.mark.parametrize("completion, reference, expected", [
    ("so the total is \\boxed{1,234}", "1234", 1.0),             # thousands separator
    ("\\boxed{\\frac{3}{4}}", "0.75", 1.0),                      # LaTeX fraction = decimal
    ("\\boxed{\\dfrac{1}{2}}", "1/2", 1.0),                      # \dfrac, nested braces
    ("\\boxed{42 \\text{ apples}}", "42", 1.0),                  # unit inside the box
    ("First \\boxed{12}, no wait, 13", "12", 1.0),               # the boxed answer beats a later number
    ("x = 5, so\n#### 42", "42", 1.0),                           # GSM8K final line
    ("#### $1,000.00", "1000", 1.0),                             # currency and trailing zeros
    ("She sold 72 clips. The answer is 72.", GSM8K_SOLUTION, 1.0),  # reference is a whole GSM8K solution
    ("The answer is -7.", "-7", 1.0),                            # negative, sentence period
    ("The answer is 7", "-7", 0.0),                              # sign matters
    ("The answer is \u22123", "-3", 1.0),                        # unicode minus
    ("The answer is 18 dollars.", "18", 1.0),                    # unit word after the number
    ("The answer is 5. I checked it 3 times.", "5", 1.0),        # the phrase ends at its sentence
    ("I think 4 + 5 = 9", "9", 1.0),                             # final number
    ("3.50", "3.5", 1.0),
    ("50%", "50", 1.0),
    ("10 - 3 = 7\n#### 8", "7", 0.0),                            # the stated final answer counts, not the work
    ("\\boxed{x+1}", "x + 1", 1.0),                              # non-numeric: normalised text
    ("\\boxed{x+1}", "y + 1", 0.0),
    ("\\boxed{5 or 6}", "5", 0.0),                               # a hedge is not a number
    ("no number at all", "3", 0.0),
    ("\\boxed{12", "12", 0.0),                                   # cut mid-box: it may have gone on to 123
    ("", "0", 0.0),
    # Written for the move to math-verify: each was scored wrongly by the hand-written checker.
    ("Final Answer: The final answer is 18. I hope it is correct.", "18", 1.0),
    ("0.5", "$\\frac{1}{2}$", 1.0),                            # LaTeX reference, plain answer
    ("It is 125 miles", "$125$ miles", 1.0),                     # units on the reference
    ("16386.2", "$16386.20$", 1.0),
    ("$D = (0, 1)$", "$D = (0, 1)$", 1.0),                       # identical on both sides
    ("1 000", "1000", 1.0),                                      # space as thousands separator
    ("$14{,}916$", "14916", 1.0),                                # LaTeX thousands separator
    ("$\\frac13$", "\\frac{1}{3}", 1.0),                         # brace-less fraction
    ("\\cfrac{1}{3}", "1/3", 1.0),                               # \cfrac, no delimiters
    ("\\boxed{+033}", "33", 1.0),
    ("$\\frac{1+\\sqrt{5}}{2}$", "2", 0.0),                       # the golden ratio is not its last digit
    ("The answer is $[1, 3)$", "[1,3)", 1.0),                    # interval
    ("$[1, 3)$", "[1,3]", 0.0),                                  # open and closed ends differ
    ("\\boxed{\\{1,2\\}}", "\\{2,1\\}", 1.0),                    # sets ignore order
    ("\\boxed{(1,2)}", "(2,1)", 0.0),                            # tuples do not
    ("\\boxed{50\\%}", "0.5", 1.0),                              # percentage
    ("x \\geq 3", "x >= 3", 1.0),                                # relation
    ("$\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}$", "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}", 1.0),  # matrix
    ("$\\begin{pmatrix}1&2\\\\3&5\\end{pmatrix}$", "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}", 0.0),
    ("so she has 1,000 dollars.\n#### 1,000", "1000", 1.0),
    ("9 - 4 = 5\n#### 4", "Ann had 9 and gave 4 away.\n#### 4", 1.0),  # GSM8K final lines on both sides
    ("The answer is 42.", "#### 42", 1.0),
    ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", 1.0),                       # symbolic equality
])
def test_answer_reward_on_tricky_formats(completion, reference, expected):
    assert answer_reward(completion, {"answer": reference}) == expected


# Odd ways of writing an answer, where our own conventions (a bare reference is boxed, LaTeX without
# delimiters is math) once cost what math-verify alone reads right.
@pytest.mark.parametrize("completion, reference, expected", [
    ("The answer is 4 4/9.", "4 4/9", 1.0),                      # a mixed number: 4 and 4/9
    ("$\\frac{40}{9}$", "4 4/9", 1.0),
    ("The answer is 4.", "4 4/9", 0.0),                          # not its whole part
    ("$4\\frac{4}{9}$", "40/9", 1.0),                             # the LaTeX mixed number
    ("It takes -2 1/2 hours", "-2.5", 1.0),
    ("The answer is 1.22", "1,22", 1.0),                         # a decimal comma in the reference
    ("$1,22$", "1.22", 1.0),                                     # ... and in the answer
    ("\\boxed{0,5}", "1/2", 1.0),
    ("$1,22$", "122", 0.0),
    ("\\boxed{1,2}", "\\{1, 2\\}", 1.0),                         # a set stays a set
    ("$\n2\\sqrt{3}\n$", "2\\sqrt{3}", 1.0),                    # inline math over several lines
    ("So\n\\(\n2\\sqrt{3}\n\\)\n", "2\\sqrt{3}", 1.0),
    ("$\n2\\sqrt{5}\n$", "2", 0.0),                              # not its first number
    ("The answer is\n\\(\n10\\pi\n\\)", "10", 0.0),
    ("It costs $5.\nSo\n$\n\\frac{1}{2}\n$", "0.5", 1.0),
])
def test_answer_reward_reads_mixed_numbers_decimal_commas_and_multiline_math(completion, reference, expected):
    assert answer_reward(completion, {"answer": reference}) == expected


# Where no convention of ours applies (a reference in math delimiters, a completion with no `####`,
# no mixed number, no decimal comma, no formula split over lines), the reward is math-verify's verdict.
@pytest.mark.parametrize("completion, reference", [
    ("The answer is $\\frac{3}{6}$", "$0.5$"),
    ("$\\sqrt{12}$", "$2\\sqrt{3}$"),
    ("$\\sqrt{12}$", "$3\\sqrt{2}$"),
    ("The answer is \\boxed{(3, -1)}", "$(3,-1)$"),
    ("\\boxed{(-1, 3)}", "$(3,-1)$"),
    ("$x \\in (2, \\infty)$", "$(2,\\infty)$"),
    ("$\\{3, 1, 2\\}$", "$\\{1,2,3\\}$"),
    ("So $y = 2x + 1$", "$2x+1$"),
    ("The final answer is $\\pi/2$", "$\\frac{\\pi}{2}$"),
    ("$25\\%$", "$\\frac{1}{4}$"),
    ("$1{,}234$", "$1234$"),
    ("I get 7 apples", "$7$"),
    ("I get 7 apples", "$8$"),
    ("$$\n\\frac{2}{3}\n$$", "$\\frac{4}{6}$"),
    ("$a^2 - b^2$", "$(a-b)(a+b)$"),
    ("$\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}$", "$\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}$"),
])
def test_answer_reward_agrees_with_math_verify_where_no_convention_applies(completion, reference):
    from math_verify import parse, verify

    assert answer_reward(completion, {"answer": reference}) == float(verify(parse(reference), parse(completion)))


def test_answer_reward_reads_the_configured_column_and_says_when_it_is_missing():
    assert answer_reward("#### 4", {"label": "4"}, answer_key="label") == 1.0
    with pytest.raises(KeyError, match="answer_key"):
        answer_reward("#### 4", {"question": "2+2"})
    with pytest.raises(ValueError, match="states no answer"):  # bad data is named, not scored 0
        answer_reward("#### 4", {"answer": "   "})


@pytest.mark.parametrize("completion, style, expected", [
    ("12 + 7 = 19\n#### 19", "hash", 1.0),
    ("12 + 7 = 19\n#### 19.", "hash", 1.0),
    ("#### 19 and then more text", "hash", 0.0),  # the final line must be the answer
    ("The answer is 19", "hash", 0.0),
    ("so \\boxed{19}", "boxed", 1.0),
    ("so 19", "boxed", 0.0),
    ("<think>12+7</think><answer>19</answer>", "answer_tag", 1.0),
    ("<answer>19</answer> trailing", "answer_tag", 0.0),
])
def test_format_reward(completion, style, expected):
    assert format_reward(completion, {}, style=style) == expected


@pytest.mark.parametrize("completion, reference, expected", [
    ("48 + 37 = 85.", "85", 1.0),
    ("The answer is 85", "85", 1.0),
    ("To add 48 and 37, first 40 + 30 = 70, then", "85", 0.0),  # cut off mid-explanation: its last number
    ("85, or maybe 86", "85", 0.0),
    ("99 - 73 = 26", "26", 1.0),
    ("48 - 73 = -25", "-25", 1.0),
    ("48 - 73 = 25", "-25", 0.0),
    ("It is 1,085.", "1085", 1.0),
    ("85.0", "85", 1.0),
    ("no number at all", "85", 0.0),
])
def test_last_number_reward_checks_the_replys_last_number_exactly(completion, reference, expected):
    assert last_number_reward(completion, {"answer": reference}) == expected


def test_last_number_reward_says_when_the_answer_column_is_missing():
    with pytest.raises(KeyError, match="last_number_reward needs the reference answer in column 'answer'"):
        last_number_reward("85", {"question": "What is 48 + 37?"})


def test_format_reward_custom_pattern_and_unknown_style():
    assert format_reward("Answer: 4", {}, pattern=r"^Answer: \d+$") == 1.0
    with pytest.raises(ValueError, match="style"):
        format_reward("x", {}, style="xml")


# --------------------------------------------------------------------------- the runner


def length_reward(completion, sample, per_char=1.0):
    return per_char * len(completion)


async def async_match(completion, sample):
    await asyncio.sleep(0.01)
    return completion == sample["answer"]


def slow(completion, sample):
    time.sleep(0.5)
    return 1.0


def broken(completion, sample):
    raise ValueError("checker crashed")


def not_a_number(completion, sample):
    return "1.0"


def run_score(specs, completion="abc", sample=None, timeout_s=5.0):
    fns = RewardFunctions.from_config(specs, timeout_s)
    components = asyncio.run(fns.score(completion, sample or {"answer": "abc"}))
    return fns, components


def test_sync_and_async_functions_weighted_and_kept_apart():
    specs = {"length": {"fn": f"{__name__}:length_reward", "weight": 0.5, "kwargs": {"per_char": 2.0}},
             "match": {"fn": f"{__name__}:async_match", "weight": 3}}
    fns, components = run_score(specs)
    assert components == {"length": 6.0, "match": 1.0}  # bool -> float
    assert fns.total(components) == 0.5 * 6.0 + 3 * 1.0


def test_a_slow_event_loop_is_not_blocked_by_a_sync_function():
    fns = RewardFunctions.from_config({"slow": {"fn": f"{__name__}:slow"}}, timeout_s=5.0)

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        await fns.score("x", {})
        task.cancel()
        return ticks

    assert asyncio.run(main()) >= 20  # the loop kept turning while the checker slept 0.5 s in a thread


@pytest.mark.parametrize("fn, message", [("slow", "timed out after 0.1 s"), ("broken", "checker crashed"),
                                         ("not_a_number", "finite number")])
def test_failures_raise_one_error_naming_the_function(fn, message):
    with pytest.raises(RewardFnError, match=f"'{fn}' failed.*{message}"):
        run_score({fn: {"fn": f"{__name__}:{fn}"}}, timeout_s=0.1)


def test_import_paths_load_like_env_classes_and_bad_ones_are_explained():
    from rl_core.rewards.math import answer_reward

    assert load_reward_fn("rl_core.rewards.math.answer_reward") is answer_reward  # the env classes' dotted form too
    with pytest.raises(ValueError, match="pkg.module:name"):
        load_reward_fn("answer_reward")
    with pytest.raises(ImportError, match="cannot import module"):
        load_reward_fn("no_such_module:fn")
    with pytest.raises(ImportError, match="not a callable"):
        load_reward_fn("rl_core.rewards.math:NUMBER")


def hang(completion, sample):
    while True:
        time.sleep(1)


def on_main_thread(completion, sample):
    import threading

    return threading.current_thread() is threading.main_thread()


@pytest.mark.timeout(120)
def test_worker_processes_run_checkers_on_a_main_thread_and_a_hung_one_costs_only_its_call():
    import multiprocessing

    from rl_core.rewards.processes import ProcessExecutor

    executor = ProcessExecutor(2)
    specs = {"hang": {"fn": f"{__name__}:hang"}}
    checkers = {"main": {"fn": f"{__name__}:on_main_thread"},
                "correct": {"fn": "rl_core.rewards.math:answer_reward"}}
    hanging = RewardFunctions.from_config(specs, timeout_s=1.0, executor=executor)
    working = RewardFunctions.from_config(checkers, timeout_s=30.0, executor=executor)

    async def main():
        with pytest.raises(RewardFnError, match="'hang' failed.*timed out"):
            await hanging.score("x", {})
        # One worker is stuck for good; the other goes on checking, with math-verify's timeouts on.
        return await asyncio.gather(*(working.score(f"#### {n}", {"answer": "12"}) for n in (12, 13)))
    try:
        right, wrong = asyncio.run(main())
    finally:
        executor.shutdown(wait=True)
    assert right == {"main": 1.0, "correct": 1.0} and wrong == {"main": 1.0, "correct": 0.0}
    assert multiprocessing.active_children() == []  # the stuck worker was killed, not waited for


def test_vader_compound_scores_a_completion_by_sentiment_through_its_import_path():
    from rl_core.rewards import load_reward_fn

    fn = load_reward_fn("rl_core.rewards.sentiment:vader_compound")
    happy, sad = fn("What a wonderful, lovely, happy day!", {}), fn("This is a terrible, awful, sad mess.", {})
    assert 0.5 < happy <= 1.0 and -1.0 <= sad < -0.5
    assert fn("", {}) == 0.0 and fn("the table is in the room", {}) == 0.0


BATCH_CALLS = []


@batched
def batch_length(completions, samples, scale=1.0):
    BATCH_CALLS.append(len(completions))
    return [scale * len(c) if c != "nan" else float("nan") for c in completions]


@batched
def batch_too_short(completions, samples):
    return [1.0]


def test_a_batched_function_scores_a_batch_in_one_call_and_fails_only_what_it_could_not_score():
    fns = RewardFunctions.from_config({"length": {"fn": f"{__name__}:batch_length", "kwargs": {"scale": 2.0}},
                                       "match": {"fn": f"{__name__}:async_match"}}, timeout_s=5.0)
    BATCH_CALLS.clear()
    results = asyncio.run(fns.score_batch(["abc", "nan", "xy"], [{"answer": "abc"}, {"answer": "x"}, {"answer": "x"}]))
    assert BATCH_CALLS == [3]  # one call for the batch; the per-item function ran once per completion
    assert results[0] == {"length": 6.0, "match": 1.0} and results[2] == {"length": 4.0, "match": 0.0}
    assert isinstance(results[1], RewardFnError) and "'length' failed" in str(results[1]) and "finite" in str(results[1])
    short = RewardFunctions.from_config({"short": {"fn": f"{__name__}:batch_too_short"}}, timeout_s=5.0)
    results = asyncio.run(short.score_batch(["a", "b"], [{}, {}]))
    assert all(isinstance(r, RewardFnError) and "one number per completion" in str(r) for r in results)


def test_vader_compounds_is_vader_compound_over_a_batch():
    from rl_core.rewards.sentiment import vader_compound, vader_compounds

    texts = ["What a wonderful day!", "", "This is awful."]
    assert vader_compounds(texts, [{}] * 3) == [vader_compound(t) for t in texts]


@batched
def tool_results_quoted(completions, samples, messages, tool_calls=None):
    """A batched function declaring the conversation: lists, one entry per completion (None: not a conversation)."""
    assert len(messages) == len(tool_calls) == len(completions)
    return [0.0 if m is None else float(any(t["content"] in c for t in m if t["role"] == "tool"))
            for c, m in zip(completions, messages)]


def tool_call_count(completion, sample, tool_calls):
    return len(tool_calls)


def test_functions_that_declare_the_conversation_get_it_batched_and_in_worker_processes():
    from rl_core.rewards.processes import ProcessExecutor

    chat = {"messages": [{"role": "user", "content": "2 * 21?"}, {"role": "assistant", "content": "<call>"},
                         {"role": "tool", "content": "42"}, {"role": "assistant", "content": "42"}],
            "tool_calls": [{"id": "call_0", "name": "calc", "arguments": {"expr": "2 * 21"}, "problem": None}]}
    executor = ProcessExecutor(1)  # the conversation reaches a worker process pickled, as plain dicts
    try:
        fns = RewardFunctions.from_config({"quoted": {"fn": f"{__name__}:tool_results_quoted"},
                                           "calls": {"fn": f"{__name__}:tool_call_count"}}, 30.0, executor)
        results = asyncio.run(fns.score_batch(["42", "41", "42"], [{}, {}, {}], [chat, chat, None]))
    finally:
        executor.shutdown(wait=True)
    assert results[:2] == [{"quoted": 1.0, "calls": 1.0}, {"quoted": 0.0, "calls": 1.0}]
    assert isinstance(results[2], RewardFnError) and "'calls' failed" in str(results[2])  # len(None): its own failure
