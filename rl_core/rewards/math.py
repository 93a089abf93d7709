"""Shipped rule-based rewards for math word problems (GSM8K-style and the tiny arithmetic recipe).

`answer_reward` gives 1.0 when the completion's final answer equals the reference answer in
`sample[answer_key]`, numerically where both are numbers ("1,000" = "1000.00" = "\\boxed{1000}",
"\\frac{3}{4}" = "0.75"), else 0.0. The final answer is read, in this order of trust, from the
last `\\boxed{...}`, a GSM8K `#### 42` line, an "answer is 42" / "Answer: 42" phrase, and
finally the last number in the text. The reference may itself be a full GSM8K solution
(everything after its `####` is the answer). `format_reward` checks only that the completion
states its final answer in the expected form.
"""

from __future__ import annotations

import re
from fractions import Fraction

NUMBER = r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?|-?\.\d+"  # 1,234.5 | 1234.5 | .5
_NUMBER_RE = re.compile(rf"(?<![\w.,])({NUMBER})(?:\s*/\s*(\d+))?")
# A span that *is* a number: currency sign, a fraction, a percent sign or a unit word may come with it.
_NUMERIC_SPAN_RE = re.compile(rf"\$?\s*({NUMBER})(?:\s*/\s*(\d+))?\s*%?\s*(?:[A-Za-z][A-Za-z ]*)?\.?")
_HASH_RE = re.compile(r"####\s*([^\n]*)")
_PHRASE_RE = re.compile(r"answer\s*(?:is|:|=)\s*:?\s*(.*?)(?:\.\s|\.?$)", re.IGNORECASE | re.MULTILINE)
_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_TEXT_RE = re.compile(r"\\(?:text|mathrm|textbf|mbox)\s*\{[^{}]*\}")
FORMATS = {
    "boxed": re.compile(r"\\boxed\s*\{"),
    "hash": re.compile(rf"####\s*\$?\s*(?:{NUMBER})\s*\.?\s*$"),  # the completion ends with its `#### N` line
    "answer_tag": re.compile(r"<answer>.*?</answer>\s*$", re.DOTALL),
}


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced; None if there is none."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0:
        return None
    depth = 0
    for position in range(brace, len(text)):
        depth += {"{": 1, "}": -1}.get(text[position], 0)
        if depth == 0:
            return text[brace + 1:position]
    return None  # unbalanced: the model stopped mid-answer


def extract_answer(text: str) -> str | None:
    """The final-answer span of a completion (boxed > `####` > "answer is" > last number), or None."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    for pattern in (_HASH_RE, _PHRASE_RE):
        matches = pattern.findall(text)
        if matches and matches[-1].strip():
            return matches[-1].strip()
    numbers = _NUMBER_RE.findall(_normalise(text))
    if numbers:
        whole, denominator = numbers[-1]
        return f"{whole}/{denominator}" if denominator else whole
    return None


def _normalise(text: str) -> str:
    text = text.replace("\u2212", "-").replace("\\!", "").replace("\\,", "").replace("\\$", "$")
    text = _FRAC_RE.sub(r"\1/\2", text)
    return _TEXT_RE.sub(" ", text)


def parse_number(text: str) -> Fraction | None:
    """An answer span's value when the span is a number: "$1,234.50" -> 1234.5, "3/4" -> 0.75,
    "-7." -> -7, "18 dollars" -> 18; None for anything else ("x+1", "5 or 6")."""
    match = _NUMERIC_SPAN_RE.fullmatch(_normalise(text).strip())
    if match is None:
        return None
    whole, denominator = match.groups()
    digits = whole.replace(",", "")
    try:
        value = Fraction(digits)
        if denominator:
            value = value / Fraction(denominator) if int(denominator) else None
    except (ValueError, ZeroDivisionError):
        return None
    return value


def _plain(text: str) -> str:
    return re.sub(r"\s+|\$|\\", "", _normalise(text)).rstrip(".").lower()


def reference_answer(reference) -> str:
    """The answer part of a reference: after `####` in a GSM8K solution, inside a `\\boxed{}`, else as is."""
    reference = str(reference)
    if "####" in reference:
        return reference.rsplit("####", 1)[1].strip()
    boxed = last_boxed(reference)
    return boxed.strip() if boxed is not None else reference.strip()


def answers_match(predicted: str | None, reference, rel_tol: float = 1e-6) -> bool:
    """Numeric equality when both parse as numbers, else equality of the normalised text."""
    if predicted is None:
        return False
    reference = reference_answer(reference)
    want, got = parse_number(reference), parse_number(predicted)
    if want is not None and got is not None:
        return abs(got - want) <= rel_tol * max(1, abs(want))
    return _plain(predicted) == _plain(reference) != ""


def answer_reward(completion: str, sample: dict, answer_key: str = "answer") -> float:
    """1.0 when the completion's final answer equals `sample[answer_key]`, else 0.0."""
    if answer_key not in sample:
        raise KeyError(f"answer_reward needs the reference answer in column {answer_key!r}; the sample has "
                       f"{sorted(k for k in sample if k != 'prompt_ids')} (set kwargs.answer_key)")
    return float(answers_match(extract_answer(completion), sample[answer_key]))


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
