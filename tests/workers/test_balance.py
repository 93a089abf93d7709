"""Invariants and balance quality of workers.balance."""

import math
import time

import pytest
import torch

from workers.balance import micro_batch_plan, micro_batches_for_rank, minibatch_indices


def lognormal_lengths(n: int, seed: int, mean_tokens: float = 300.0, sigma: float = 1.0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    mu = math.log(mean_tokens) - sigma**2 / 2
    samples = torch.exp(mu + sigma * torch.randn(n, generator=generator, dtype=torch.float64))
    return [max(1, int(x)) for x in samples.clamp(max=4096).tolist()]


def totals(partitions, lengths):
    return [sum(lengths[i] for i in part) for part in partitions]


def padded(batch, lengths):
    return len(batch) * max((lengths[i] for i in batch), default=0)


@pytest.mark.parametrize(
    "n,dp_size,max_tokens", [(1, 1, 10), (7, 2, 50), (100, 4, 2048), (513, 8, 8192), (64, 3, 4096), (3, 4, 100)]
)
def test_plan_invariants(n, dp_size, max_tokens):
    lengths = [min(max_tokens, x) for x in lognormal_lengths(n, seed=n)]
    plan = micro_batch_plan(lengths, dp_size, max_tokens)
    assert len(plan) == dp_size and len({len(batches) for batches in plan}) == 1  # same count on every rank
    assert sorted(i for batches in plan for batch in batches for i in batch) == list(range(n))
    assert all(padded(batch, lengths) <= max_tokens for batches in plan for batch in batches)
    for batches in plan:  # length-sorted: every sequence of a micro-batch is at least as long as the next one's
        real = [batch for batch in batches if batch]
        for a, b in zip(real, real[1:]):
            assert min(lengths[i] for i in a) >= max(lengths[i] for i in b)
    assert plan[min(1, dp_size - 1)] == micro_batches_for_rank(lengths, min(1, dp_size - 1), dp_size, max_tokens)


def test_micro_batch_count_is_the_fewest_that_fit_once_padded():
    # 10 x 100 tokens, max 250: two per micro-batch fit (200), three do not (300)
    assert [len(b) for b in micro_batch_plan([100] * 10, 1, 250)[0]] == [2, 2, 2, 2, 2]
    # one long and many short: the long one goes alone, the short ones together
    lengths = [90] + [10] * 9
    assert micro_batch_plan(lengths, 1, 100)[0] == [[0], list(range(1, 10))]


def test_ranks_with_fewer_micro_batches_split_the_biggest_or_stand_in():
    lengths = [50, 50, 50, 50, 10, 10]
    plan = micro_batch_plan(lengths, 2, 100)
    assert len(plan[0]) == len(plan[1])
    assert micro_batch_plan([5, 7, 3], 4, 100)[3] == [[]]  # more ranks than sequences: a stand-in


def test_sequence_longer_than_max_tokens_is_a_clear_error():
    with pytest.raises(ValueError, match=r"5000 tokens exceeds max_tokens=4096"):
        micro_batch_plan([10, 5000, 20], dp_size=2, max_tokens=4096)
    with pytest.raises(ValueError, match="no sequences"):
        micro_batch_plan([], dp_size=2, max_tokens=10)
    with pytest.raises(ValueError, match="outside"):
        micro_batches_for_rank([1, 2], 2, 2, 10)


def test_balance_and_padding_on_lognormal_lengths():
    lengths = lognormal_lengths(1024, seed=0)
    for dp_size in (2, 4, 8):
        plan = micro_batch_plan(lengths, dp_size, max_tokens=16384)
        per_rank = [sum(totals(batches, lengths)) for batches in plan]
        balanced_ratio = max(per_rank) / (sum(per_rank) / dp_size)
        chunk = len(lengths) // dp_size
        equal_count = [sum(lengths[r * chunk:(r + 1) * chunk]) for r in range(dp_size)]
        assert balanced_ratio <= 1.02, (dp_size, balanced_ratio)
        assert balanced_ratio < max(equal_count) / (sum(equal_count) / dp_size)
        # Padding: against micro-batches of the same shares and counts, dealt out in no length order.
        waste = 1 - sum(per_rank) / sum(padded(b, lengths) for batches in plan for b in batches)
        unsorted = [[share[j::len(batches)] for j in range(len(batches))]
                    for share, batches in zip((sorted(i for b in bs for i in b) for bs in plan), plan)]
        unsorted_waste = 1 - sum(per_rank) / sum(padded(b, lengths) for batches in unsorted for b in batches)
        assert waste < 0.4 and waste < unsorted_waste / 2, (dp_size, waste, unsorted_waste)


def test_plan_speed_4096_sequences():
    lengths = lognormal_lengths(4096, seed=1)
    start = time.perf_counter()
    micro_batch_plan(lengths, dp_size=8, max_tokens=16384)
    elapsed = time.perf_counter() - start
    assert elapsed < 0.5, f"{elapsed * 1000:.0f} ms (target < 200 ms; loose bound for a busy CI box)"


def test_minibatch_indices_reshuffle_each_epoch():
    generator = torch.Generator().manual_seed(0)
    epoch_a = minibatch_indices(8, 2, generator)
    epoch_b = minibatch_indices(8, 2, generator)
    for epoch in (epoch_a, epoch_b):
        assert len(epoch) == 2 and all(len(mb) == 4 for mb in epoch)
        assert sorted(i for mb in epoch for i in mb) == list(range(8))
    assert epoch_a != epoch_b
    uneven = minibatch_indices(10, 3, generator)  # e.g. 12 trajectories of which 2 failed
    assert sorted(len(mb) for mb in uneven) == [3, 3, 4] and sorted(sum(uneven, [])) == list(range(10))
    with pytest.raises(ValueError, match="cannot be cut"):
        minibatch_indices(2, 3, generator)
