"""Reward-model losses against hand formulas; ranks and Spearman with ties."""

import json
import math

import pytest
import torch

from rl_core.preferences import DEFAULT_MARGIN_MAP, load_preference_dataset
from rl_core.reward_model.losses import (
    average_ranks,
    best_of_n_loss,
    pairwise_loss,
    preference_correct,
    preference_loss,
    spearman,
)


def bt_loss(chosen, rejected, margin=0.0):
    return -math.log(1.0 / (1.0 + math.exp(-(chosen - rejected - margin))))


def test_pairwise_loss_matches_hand_formula_per_example():
    chosen, rejected = [1.5, -0.2, 0.0], [0.5, 0.3, 2.0]
    loss = pairwise_loss(torch.tensor(chosen), torch.tensor(rejected))
    assert loss.shape == (3,)
    for got, c, r in zip(loss.tolist(), chosen, rejected):
        assert got == pytest.approx(bt_loss(c, r), rel=1e-6)


def test_margin_raises_the_loss_by_the_hand_value():
    chosen, rejected, margins = [1.5, -0.2, 0.0], [0.5, 0.3, 2.0], [3.0, 1.0, 0.0]
    plain = pairwise_loss(torch.tensor(chosen), torch.tensor(rejected))
    with_margin = pairwise_loss(torch.tensor(chosen), torch.tensor(rejected), torch.tensor(margins))
    for got, c, r, m in zip(with_margin.tolist(), chosen, rejected, margins):
        assert got == pytest.approx(bt_loss(c, r, m), rel=1e-6)
    assert (with_margin[:2] > plain[:2]).all()
    assert with_margin[2] == pytest.approx(plain[2].item())


def test_margin_from_llama2_file_flows_into_the_loss(tmp_path):
    rows = [{"prompt": "p", "response_1": "a", "response_2": "b", "chosen_response": 2,
             "prefer_degree": degree} for degree in ("significantly better", "better")]
    path = tmp_path / "l2.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    examples, _ = load_preference_dataset(path, margin_map=DEFAULT_MARGIN_MAP)
    scores = torch.tensor([[0.2, 1.0], [0.2, 1.0]])
    best = torch.tensor([e.best for e in examples])
    margin = torch.tensor([e.margin for e in examples])
    loss = preference_loss(scores, best, margin)
    assert loss.tolist() == pytest.approx([bt_loss(1.0, 0.2, 3.0), bt_loss(1.0, 0.2, 2.0)])


def test_preference_loss_pairs_follow_the_best_index():
    scores = torch.tensor([[2.0, 0.5], [2.0, 0.5]])
    loss = preference_loss(scores, torch.tensor([0, 1]))
    assert loss.tolist() == pytest.approx([bt_loss(2.0, 0.5), bt_loss(0.5, 2.0)])


def test_pairwise_gradient_pushes_chosen_up_and_rejected_down():
    scores = torch.tensor([[0.3, 0.1]], requires_grad=True)
    preference_loss(scores, torch.tensor([1])).sum().backward()
    assert scores.grad[0, 1] < 0 < scores.grad[0, 0]


def test_best_of_four_loss_is_softmax_cross_entropy():
    scores = [[0.1, 2.0, -1.0, 0.5], [1.0, 1.0, 1.0, 1.0], [3.0, -2.0, 0.0, 0.7]]
    best = [1, 2, 3]
    expected = [-s[b] + math.log(sum(math.exp(v) for v in s)) for s, b in zip(scores, best)]
    got = best_of_n_loss(torch.tensor(scores), torch.tensor(best))
    assert got.tolist() == pytest.approx(expected, rel=1e-6)
    assert preference_loss(torch.tensor(scores), torch.tensor(best)).tolist() == \
        pytest.approx(expected, rel=1e-6)
    assert got[1].item() == pytest.approx(math.log(4))


def test_margins_with_more_than_two_candidates_are_refused():
    with pytest.raises(ValueError, match="margins apply to pairs only"):
        preference_loss(torch.zeros(2, 4), torch.tensor([0, 1]), torch.tensor([1.0, 0.0]))
    zero_margin = preference_loss(torch.zeros(2, 4), torch.tensor([0, 1]), torch.zeros(2))
    assert zero_margin.tolist() == pytest.approx([math.log(4)] * 2)


def test_bad_shapes_and_indices_are_explained():
    with pytest.raises(ValueError, match="best indices must lie in"):
        preference_loss(torch.zeros(2, 2), torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="scores must have shape"):
        preference_loss(torch.zeros(2), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="same shape"):
        pairwise_loss(torch.zeros(2), torch.zeros(3))


def test_accuracy_counts_strict_wins_only():
    scores = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.5, 0.5], [0.1, 0.7]])
    best = torch.tensor([0, 0, 1, 1])
    assert preference_correct(scores, best).mean() == pytest.approx(2 / 4)  # rows 0 and 3; tie is wrong
    four = torch.tensor([[0.1, 0.7, 0.3, 0.0], [1.0, 0.0, 1.0, 0.0]])
    assert preference_correct(four, torch.tensor([1, 0])).mean() == pytest.approx(0.5)


def test_average_ranks_share_ties():
    assert average_ranks([10.0, 30.0, 20.0, 20.0, 5.0]).tolist() == [2.0, 5.0, 3.5, 3.5, 1.0]


def pearson(a, b):
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b))
    return cov / math.sqrt(sum((x - ma) ** 2 for x in a) * sum((y - mb) ** 2 for y in b))


def test_spearman_with_ties_matches_hand_ranks():
    x = [1.0, 2.0, 2.0, 3.0, 7.0]
    y = [10.0, 30.0, 20.0, 40.0, 40.0]
    ranks_x = [1.0, 2.5, 2.5, 4.0, 5.0]  # by hand
    ranks_y = [1.0, 3.0, 2.0, 4.5, 4.5]
    assert spearman(x, y) == pytest.approx(pearson(ranks_x, ranks_y))
    assert spearman(torch.tensor(x), torch.tensor(y)) == pytest.approx(pearson(ranks_x, ranks_y))


def test_spearman_extremes_and_errors():
    assert spearman([1, 2, 3, 4], [1, 8, 27, 64]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))
    with pytest.raises(ValueError, match="equal length"):
        spearman([1, 2], [1, 2, 3])
