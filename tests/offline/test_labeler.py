"""Offline labelers: real VADER scores and the noise models."""

import math

import pytest

from offline.labeler import DescriptivenessLabeler, SentimentLabeler, get_labeler

POSITIVE = "and she smiled, happy and grateful for the wonderful day."
NEGATIVE = "and she cried, miserable and angry about the terrible day."
PLAIN = "and he went to the shop to get the milk."
DESCRIPTIVE = "and the old, dusty house stood quietly beside the dark, misty river."


def test_sentiment_scores_positive_above_negative():
    positive, negative, plain = SentimentLabeler().score([POSITIVE, NEGATIVE, PLAIN])
    assert positive > plain > negative
    assert -1.0 <= negative < 0.0 < positive <= 1.0


def test_descriptiveness_counts_adjectives_and_adverbs():
    labeler = DescriptivenessLabeler()
    descriptive, plain = labeler.score([DESCRIPTIVE, PLAIN])
    assert descriptive >= 5 and plain == 0
    assert labeler.score(["the family table"]) == [0.0]  # -ly / -able nouns are not counted


def test_noise_free_labels_are_deterministic_and_follow_the_order():
    labeler = SentimentLabeler(noise=0.0, seed=1)
    assert {labeler.label_group("q", [POSITIVE, NEGATIVE]) for _ in range(50)} == {0}
    assert {labeler.label_group("q", [NEGATIVE, POSITIVE]) for _ in range(50)} == {1}
    assert labeler.label_group("q", [PLAIN, NEGATIVE, POSITIVE, PLAIN]) == 2
    assert get_labeler("descriptiveness").label_group("q", [PLAIN, DESCRIPTIVE]) == 1


def test_half_noise_flips_about_half_the_labels():
    labeler = SentimentLabeler(noise=0.5, seed=123)
    draws = 4000
    flips = sum(labeler.label_group("q", [POSITIVE, NEGATIVE]) != 0 for _ in range(draws))
    assert abs(flips / draws - 0.5) < 0.04  # ~5 standard deviations


def test_full_noise_always_flips_and_four_way_noise_picks_another():
    assert {SentimentLabeler(noise=1.0).label_group("q", [POSITIVE, NEGATIVE])
            for _ in range(20)} == {1}
    labeler = SentimentLabeler(noise=1.0, seed=0)
    picks = {labeler.label_group("q", [NEGATIVE, POSITIVE, PLAIN, NEGATIVE]) for _ in range(200)}
    assert picks == {0, 2, 3}


def test_bradley_terry_sampling_matches_the_sigmoid_of_the_gap():
    labeler = SentimentLabeler(temperature=0.5, seed=7)
    positive, negative = labeler.score([POSITIVE, NEGATIVE])
    expected = 1.0 / (1.0 + math.exp(-(positive - negative) / 0.5))
    draws = 4000
    wins = sum(labeler.label_group("q", [POSITIVE, NEGATIVE]) == 0 for _ in range(draws))
    tolerance = 5 * math.sqrt(expected * (1 - expected) / draws)
    assert abs(wins / draws - expected) < tolerance
    assert 0.5 < expected < 1.0


def test_ties_are_broken_at_random_not_towards_index_zero():
    labeler = SentimentLabeler(seed=3)
    picks = [labeler.label_group("q", [PLAIN, PLAIN]) for _ in range(200)]
    assert 50 < sum(picks) < 150


def test_bad_settings_are_explained():
    with pytest.raises(ValueError, match="noise=1.5 must be a probability"):
        SentimentLabeler(noise=1.5)
    with pytest.raises(ValueError, match="unknown labeler 'toxicity'"):
        get_labeler("toxicity")
    with pytest.raises(ValueError, match="at least 2 responses"):
        SentimentLabeler().label_group("q", [POSITIVE])
