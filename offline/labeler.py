"""Offline stand-ins for human labelers, so the stylistic tasks get preference labels.

Ziegler et al. (2019) had people pick the best of four continuations of a query. With no
raters, a scorer plays that role: VADER's compound sentiment for the sentiment task, a count
of descriptive words for the descriptiveness task. Label noise (a flip probability, or
Bradley-Terry sampling with a temperature) makes the labels as imperfect as human ones.
"""

from __future__ import annotations

import math
import random
import re
from typing import Sequence

# Common English adjectives and adverbs; with the suffix rule below this is a crude but
# vader-independent "how descriptive is this text" signal.
DESCRIPTIVE_WORDS = frozenset("""
    beautiful bright dark cold warm hot soft hard loud quiet small large tiny huge big little
    old young new ancient fresh gentle rough smooth sharp dull heavy light thick thin tall
    short long wide narrow deep shallow green blue red yellow white black golden silver grey
    gray pale vivid brilliant shiny dusty muddy wet dry sweet bitter sour salty fragrant
    strange lovely pretty ugly graceful elegant fierce wild calm still silent noisy busy empty
    crowded lonely happy sad angry tired sleepy eager proud brave shy nervous anxious cheerful
    gloomy grim pleasant delicate crisp misty foggy sunny rainy stormy windy icy frozen
    crimson scarlet emerald velvet silky wooden stone rusty broken shattered tangled twisted
    massive enormous slender fragile ornate rich faint dim glowing sparkling gleaming
    shimmering flickering towering sprawling weathered worn tattered
    very quite rather really almost nearly barely
""".split())
DESCRIPTIVE_SUFFIXES = ("ly", "ful", "ous", "less", "ive", "able", "ible")
# Words with those endings that are not adjectives or adverbs.
NOT_DESCRIPTIVE = frozenset("""
    family assembly butterfly anomaly monopoly mouthful handful spoonful
    motive detective relative perspective objective executive directive archive
    vegetable constable
""".split())
WORD = re.compile(r"[a-z]+")


def _choose(scores: Sequence[float], rng: random.Random, noise: float,
            temperature: float) -> int:
    """Index of the preferred candidate under the labeler's noise model.

    temperature > 0: sample from softmax(scores / temperature) (Bradley-Terry for a pair);
    temperature == 0: argmax with ties broken at random (so ties don't favour index 0).
    Then, with probability ``noise``, answer one of the other candidates instead.
    """
    if temperature > 0:
        top = max(scores)
        weights = [math.exp((s - top) / temperature) for s in scores]
        choice = rng.choices(range(len(scores)), weights=weights)[0]
    else:
        top = max(scores)
        choice = rng.choice([i for i, s in enumerate(scores) if s == top])
    if noise > 0 and rng.random() < noise:
        choice = rng.choice([i for i in range(len(scores)) if i != choice])
    return choice


class _Labeler:
    """Shared labelling logic; subclasses define `score`."""

    name = "base"

    def __init__(self, noise: float = 0.0, temperature: float = 0.0, seed: int = 0):
        if not 0.0 <= noise <= 1.0:
            raise ValueError(f"noise={noise} must be a probability in [0, 1]")
        if temperature < 0:
            raise ValueError(f"temperature={temperature} must be >= 0 (0 = no sampling)")
        self.noise = noise
        self.temperature = temperature
        self.rng = random.Random(seed)

    def score(self, texts: Sequence[str]) -> list[float]:
        raise NotImplementedError

    def label_group(self, query: str, responses: Sequence[str]) -> int:
        """Index of the preferred response among continuations of ``query``.

        Only the responses are scored: they share the query, and scoring it along would dilute
        the difference a rater is asked to judge.
        """
        if len(responses) < 2:
            raise ValueError(f"need at least 2 responses to compare, got {len(responses)}")
        return self.choose(self.score(responses))

    def choose(self, scores: Sequence[float]) -> int:
        """Index this labeler prefers given its own ``score`` of each response (noise applied)."""
        return _choose(scores, self.rng, self.noise, self.temperature)


class SentimentLabeler(_Labeler):
    """Prefers the more positive continuation (VADER compound score in [-1, 1])."""

    name = "sentiment"

    def __init__(self, noise: float = 0.0, temperature: float = 0.0, seed: int = 0):
        super().__init__(noise, temperature, seed)
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

        self.analyzer = SentimentIntensityAnalyzer()

    def score(self, texts: Sequence[str]) -> list[float]:
        return [self.analyzer.polarity_scores(text)["compound"] for text in texts]


def is_descriptive(word: str) -> bool:
    """Whether a lower-case word looks like an adjective or adverb (word list + suffixes)."""
    if word in DESCRIPTIVE_WORDS:
        return True
    if word in NOT_DESCRIPTIVE or len(word) < 6:
        return False
    return word.endswith(DESCRIPTIVE_SUFFIXES)


class DescriptivenessLabeler(_Labeler):
    """Prefers the continuation with more descriptive words (adjectives/adverbs)."""

    name = "descriptiveness"

    def score(self, texts: Sequence[str]) -> list[float]:
        return [float(sum(is_descriptive(w) for w in WORD.findall(t.lower()))) for t in texts]


LABELERS = {"sentiment": SentimentLabeler, "descriptiveness": DescriptivenessLabeler}


def get_labeler(name: str, **kwargs) -> _Labeler:
    """A labeler by task name ("sentiment" or "descriptiveness"); kwargs go to its constructor."""
    if name not in LABELERS:
        raise ValueError(f"unknown labeler {name!r}; choose one of {sorted(LABELERS)}")
    return LABELERS[name](**kwargs)
