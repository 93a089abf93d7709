"""A rule-based sentiment reward: VADER's compound score of the completion, in [-1, 1].

A reward function (no learned model) that both this project and other trainers can call the same
way, e.g. `scripts/bench_vs_trl.py --setting gpu86m`, where a randomly initialised policy can still
move it (more positive words). VADER is a lexicon and rule set; the analyzer is built once per process.
"""

from __future__ import annotations

from functools import lru_cache

from rl_core.rewards import batched


@lru_cache(maxsize=1)
def _analyzer():
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    return SentimentIntensityAnalyzer()


def vader_compound(completion: str, sample: dict | None = None, **kwargs) -> float:
    """VADER's compound polarity of `completion` (-1 most negative, 1 most positive, 0 neutral or empty)."""
    return float(_analyzer().polarity_scores(completion)["compound"])


@batched
def vader_compounds(completions: list[str], samples: list[dict] | None = None, **kwargs) -> list[float]:
    """`vader_compound` of a whole batch in one call: at 0.1 ms a completion, a call each would cost more than it."""
    return [vader_compound(completion) for completion in completions]
