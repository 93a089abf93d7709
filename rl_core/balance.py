"""Sequence balancing across data-parallel ranks, and the minibatch shuffle (PPO and reward-model jobs).

Every rank holds the whole batch; each one trains on its share:

    for minibatch in minibatch_indices(batch, nminibatches, generator):     # reshuffled every epoch
        mine = micro_batches_for_rank([seqlen[i] for i in minibatch], rank, dp_size, max_tokens)
        for indices, real in with_stand_ins(mine):                            # gradient accumulation
            ...                                                               # loss x real, scaled globally

Partition indices are positions in the list given to :func:`balanced_partitions`.
"""

from __future__ import annotations

import heapq
import math
from typing import Sequence

import torch

def _karmarkar_karp(seqlens: Sequence[int], k: int) -> list[list[int]]:
    """Largest-differencing k-way partition of ``seqlens`` into index lists.

    Each heap entry is a k-tuple of part sums kept sorted largest first (stored sparsely: the
    trailing empty parts are implicit zeros), keyed by its spread (max - min). The two entries
    with the largest spread are merged by pairing the biggest part of one with the smallest of
    the other, which cancels their imbalance. Parts are group ids; merging two non-empty parts
    records a new id in a merge tree that is flattened once at the end, so a merge costs O(k).
    """
    n = len(seqlens)
    merged_left: list[int] = []  # group id n + i is the union of merged_left[i] and merged_right[i]
    merged_right: list[int] = []
    heap = [(-length, index, [(length, index)]) for index, length in enumerate(seqlens)]
    heapq.heapify(heap)
    tiebreak = n
    while len(heap) > 1:
        _, _, parts_a = heapq.heappop(heap)
        _, _, parts_b = heapq.heappop(heap)
        # Part j of a meets part k-1-j of b; a part facing an implicit zero is carried over as is.
        unpaired_a, unpaired_b = max(0, k - len(parts_b)), max(0, k - len(parts_a))
        parts = parts_a[:unpaired_a] + parts_b[:unpaired_b]
        for j in range(unpaired_a, len(parts_a)):
            sum_a, group_a = parts_a[j]
            sum_b, group_b = parts_b[k - 1 - j]
            parts.append((sum_a + sum_b, n + len(merged_left)))
            merged_left.append(group_a)
            merged_right.append(group_b)
        parts.sort(key=_part_sum, reverse=True)
        smallest = parts[-1][0] if len(parts) == k else 0
        heapq.heappush(heap, (smallest - parts[0][0], tiebreak, parts))
        tiebreak += 1
    groups = [group for _, group in heap[0][2]]
    partitions = [_expand_group(group, n, merged_left, merged_right) for group in groups]
    return partitions + [[] for _ in range(k - len(partitions))]


def _part_sum(part: tuple[int, int]) -> int:
    return part[0]


def _expand_group(root: int, n: int, merged_left: list[int], merged_right: list[int]) -> list[int]:
    """Sorted item indices under one node of the merge tree (ids < n are items)."""
    members, stack = [], [root]
    while stack:
        node = stack.pop()
        if node < n:
            members.append(node)
        else:
            stack.append(merged_left[node - n])
            stack.append(merged_right[node - n])
    return sorted(members)


def balanced_partitions(seqlens: Sequence[int], dp_size: int, max_tokens: int) -> list[list[int]]:
    """Split sequence indices into token-balanced micro-batches, a multiple of ``dp_size`` of them.

    Starts from the smallest multiple of ``dp_size`` that is at least
    ``ceil(sum(seqlens) / max_tokens)`` (fewer parts could not all fit) and adds ``dp_size``
    until no part exceeds ``max_tokens``. Parts come back ordered by token count, largest first,
    each non-empty whenever there are at least as many sequences as parts.
    """
    if dp_size < 1 or max_tokens < 1:
        raise ValueError(f"need dp_size >= 1 and max_tokens >= 1, got dp_size={dp_size}, max_tokens={max_tokens}")
    lengths = [int(length) for length in seqlens]
    if not lengths:
        raise ValueError("balanced_partitions got no sequences; the minibatch is empty")
    if min(lengths) < 0:
        raise ValueError(f"sequence lengths must be >= 0, got {min(lengths)}")
    longest = max(lengths)
    if longest > max_tokens:
        raise ValueError(f"a sequence of {longest} tokens exceeds max_tokens={max_tokens} per micro-batch; "
                         f"raise max_tokens to at least {longest} or shorten the sequences")
    lower_bound = max(1, math.ceil(sum(lengths) / max_tokens))
    k = math.ceil(lower_bound / dp_size) * dp_size
    while True:
        partitions = _karmarkar_karp(lengths, k)
        totals = [sum(lengths[i] for i in part) for part in partitions]
        if max(totals) <= max_tokens:
            order = sorted(range(k), key=lambda p: -totals[p])
            return [partitions[p] for p in order]
        k += dp_size


def partitions_for_rank(partitions: list[list[int]], rank: int, dp_size: int) -> list[list[int]]:
    """This rank's micro-batches: partition ``i`` goes to rank ``i % dp_size`` (round robin).

    Round robin over the largest-first order spreads the biggest parts evenly, and every rank
    gets the same number of micro-batches, so FSDP collectives line up on every rank.
    """
    if not 0 <= rank < dp_size:
        raise ValueError(f"rank {rank} is outside [0, dp_size={dp_size})")
    if len(partitions) % dp_size:
        raise ValueError(f"{len(partitions)} partitions cannot be shared equally by {dp_size} ranks; "
                         "build them with balanced_partitions(..., dp_size, ...)")
    return partitions[rank::dp_size]


def minibatch_indices(batch_size: int, nminibatches: int, generator: torch.Generator | None = None) -> list[list[int]]:
    """One epoch's shuffle: a fresh permutation of the batch cut into ``nminibatches`` parts, equal
    when the batch divides evenly, else differing by at most one (a batch short of failed trajectories)."""
    if nminibatches < 1 or batch_size < nminibatches:
        raise ValueError(f"batch_size={batch_size} cannot be cut into nminibatches={nminibatches}; "
                         "pick nminibatches between 1 and the batch size")
    order = torch.randperm(batch_size, generator=generator)
    return [part.tolist() for part in order.tensor_split(nminibatches)]


def micro_batches_for_rank(lengths: Sequence[int], rank: int, dp_size: int, max_tokens: int) -> list[list[int]]:
    """This rank's token-balanced micro-batches (index lists; the same count on every rank)."""
    return partitions_for_rank(balanced_partitions(lengths, dp_size, max_tokens), rank, dp_size)


def with_stand_ins(micro_batches: list[list[int]]) -> list[tuple[list[int], bool]]:
    """``(indices, real)`` per micro-batch. FSDP forwards are collectives, so a rank runs every one
    of its micro-batches even when a partition came out empty (fewer items than partitions):
    that one stands in with item 0 and must contribute nothing (``real`` is False)."""
    return [(indices or [0], bool(indices)) for indices in micro_batches]
