"""Shipped rule-based rewards for math problems (GSM8K, MATH-style and the tiny arithmetic recipe).

`answer_reward` gives 1.0 when the completion's final answer is mathematically equal to the
reference in `sample[answer_key]`, else 0.0, decided by Hugging Face's `math-verify` (what veRL,
TRL and others use): the answer is taken from a `\\boxed{}`, an "answer is" phrase or the last
expression, then compared symbolically (numbers with separators, fractions, percentages, units,
intervals, sets, tuples, matrices, relations). Conventions of ours on top: a GSM8K `#### 42`
line states the final answer (on both sides: the reference may be a whole GSM8K solution), LaTeX
written without math delimiters is read as math, a bare reference is the whole answer, a mixed
number `4 4/9` is 4 and 4/9, a decimal comma `1,22` is 1.22 where the answer is a number, and inline
math split over lines (`$` or `\\(` alone on a line) is one formula. Each reads right what
math-verify alone would read wrong; elsewhere the verdict is math-verify's. `format_reward` checks
only that the completion states its final answer in the expected form.

math-verify bounds parsing and comparison with `signal` timeouts, which only a main thread can
receive: the job runs sync reward functions in worker processes (`reward.fn_processes`), where
each call is on a main thread; in any other thread the timeouts are off and only
`reward.fn_timeout_s` bounds the call.
"""

from __future__ import annotations

import re
import threading

from math_verify import parse, verify
from sympy import Number

NUMBER = r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?|-?\.\d+"  # 1,234.5 | 1234.5 | .5
FORMATS = {
    "boxed": re.compile(r"\\boxed\s*\{"),
    "hash": re.compile(rf"####\s*\$?\s*(?:{NUMBER})\s*\.?\s*$"),  # the completion ends with its `#### N` line
    "answer_tag": re.compile(r"<answer>.*?</answer>\s*$", re.DOTALL),
}
MATH_DELIMITERS = ("$", "\\(", "\\[", "\\boxed")
# Inline math with the formula on its own line ("$\n2\\sqrt{3}\n$"): math-verify reads inline math on one
# line only, and would take the first number it sees instead ("2"). ($$ display math it reads whole.)
SPLIT_INLINE_MATH = re.compile(r"(?<!\$)\$(?!\$)[ \t]*\n([^$]*?)\n[ \t]*\$(?!\$)|\\\([ \t]*\n(.*?)\n[ \t]*\\\)",
                               re.DOTALL)
# A mixed number in plain text ("4 4/9" = 40/9): math-verify would read its whole part alone.
MIXED_NUMBER = re.compile(r"(?<![\w.,/^{}])(\d+) +(\d+)/(\d+)(?![\w,/]|\.\d)")
# A decimal comma ("1,22" = 1.22): any number of digits after it but three (then it groups thousands).
DECIMAL_COMMA = re.compile(r"(?<![\d.,])(-?\d+),(\d{1,2}|\d{4,})(?![\d.,])")
TIMEOUT_S = 5  # math-verify's own bound on one parse or comparison (where signals work)


def _math_text(text: str) -> str:
    """The part that states the answer (after a GSM8K `####`), LaTeX wrapped in `$...$` when it has no delimiters."""
    text = str(text).replace("\u2212", "-")  # a typeset minus sign
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    text = SPLIT_INLINE_MATH.sub(_one_line_formula, text.strip())
    text = MIXED_NUMBER.sub(_improper_fraction, text)
    if "\\" in text and not any(mark in text for mark in MATH_DELIMITERS):
        text = f"${text}$"
    return text


def _one_line_formula(match: re.Match) -> str:
    dollar, parenthesis = match.groups()
    return f"${' '.join((dollar if dollar is not None else parenthesis).split())}$"


def _improper_fraction(match: re.Match) -> str:
    whole, numerator, denominator = (int(part) for part in match.groups())
    if not 0 < numerator < denominator:  # "2 3/2" or "2 0/5" is no mixed number: leave it
        return match.group(0)
    return f"{whole * denominator + numerator}/{denominator}"


def _reference(text) -> str:
    """A bare reference ("18", "\\frac{1}{2}", "[1,3)") is the whole answer: boxed, so it is read as one."""
    text = _math_text(text)
    # Boxed, "1,22" would be the set {1, 22}; read as plain text (by math-verify too) it is 1.22.
    text = DECIMAL_COMMA.sub(r"\1.\2", text) if DECIMAL_COMMA.fullmatch(text) else text
    return text if any(mark in text for mark in MATH_DELIMITERS) else f"\\boxed{{{text}}}"


def answer_reward(completion: str, sample: dict, answer_key: str = "answer") -> float:
    """1.0 when the completion's final answer equals `sample[answer_key]` (math-verify), else 0.0."""
    if answer_key not in sample:
        raise KeyError(f"answer_reward needs the reference answer in column {answer_key!r}; the sample has "
                       f"{sorted(k for k in sample if k != 'prompt_ids')} (set kwargs.answer_key)")
    timeout = TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold = parse(_reference(sample[answer_key]), parsing_timeout=timeout)
    if not gold:
        raise ValueError(f"reference answer {sample[answer_key]!r} (column {answer_key!r}) states no answer "
                         "math-verify can read")
    text = _math_text(completion)
    predicted = parse(text, parsing_timeout=timeout)
    if bool(predicted) and verify(gold, predicted, timeout_seconds=timeout):
        return 1.0
    # In math, "1,22" is a list; when the reference is one number no list can equal it, so a decimal
    # comma is the only reading that can (the retry never turns a right answer wrong).
    with_points = DECIMAL_COMMA.sub(r"\1.\2", text)
    if with_points == text or not isinstance(gold[0], Number):
        return 0.0
    predicted = parse(with_points, parsing_timeout=timeout)
    return float(bool(predicted) and verify(gold, predicted, timeout_seconds=timeout))


def format_reward(completion: str, sample: dict, style: str = "hash", pattern: str | None = None) -> float:
    """1.0 when the completion states its final answer in the expected form, else 0.0.

    `style`: "hash" (ends with a `#### <number>` line), "boxed" (has a `\\boxed{}`),
    "answer_tag" (ends with `<answer>...</answer>`); or any regex in `pattern` (searched).
    """
    if pattern is not None:
        return float(re.search(pattern, completion, re.DOTALL) is not None)
    if style not in FORMATS:
        raise ValueError(f"format_reward style={style!r} is not one of {sorted(FORMATS)}; or give a regex in pattern")
    return float(FORMATS[style].search(completion.strip()) is not None)


LAST_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_number_reward(completion: str, sample: dict, answer_key: str = "answer") -> float:
    """1.0 when the last number in the completion equals `sample[answer_key]` exactly, else 0.0: the plain
    check for short arithmetic answers ("48 + 37 = 85." and "The answer is 85" both state 85), where a
    reply cut off mid-explanation ends on some other number. Thousands separators are ignored."""
    if answer_key not in sample:
        raise KeyError(f"last_number_reward needs the reference answer in column {answer_key!r}; the sample has "
                       f"{sorted(k for k in sample if k != 'prompt_ids')} (set kwargs.answer_key)")
    numbers = LAST_NUMBER.findall(completion.replace("\u2212", "-"))
    if not numbers:
        return 0.0
    last, gold = numbers[-1].replace(",", "").rstrip("."), str(sample[answer_key]).replace(",", "").strip()
    try:
        return float(float(last) == float(gold))
    except ValueError:
        return 0.0
