"""Sequence balancing across data-parallel ranks (`workers.worker` uses it for every job), and the minibatch shuffle.

Every rank holds the whole batch; each one trains on its share:

    for minibatch in minibatch_indices(batch, nminibatches, generator):     # reshuffled every epoch
        mine = micro_batches_for_rank([seqlen[i] for i in minibatch], rank, dp_size, max_tokens)
        for indices, real in with_stand_ins(mine):                            # gradient accumulation
            ...                                                               # loss x real, scaled globally

Two levels: Karmarkar-Karp splits the tokens evenly across ranks (so no rank waits for the
others at the next collective), then each rank cuts its share into micro-batches of similar
lengths (so padding to the longest sequence of a micro-batch wastes little), the same number on
every rank (FSDP collectives line up). Indices are positions in the list of lengths given.
"""

from __future__ import annotations

import heapq
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


def rank_shares(seqlens: Sequence[int], dp_size: int) -> list[list[int]]:
    """Split sequence indices into ``dp_size`` shares of (nearly) equal token count (Karmarkar-Karp)."""
    if dp_size < 1:
        raise ValueError(f"need dp_size >= 1, got {dp_size}")
    return _karmarkar_karp([int(length) for length in seqlens], dp_size)


def length_sorted_micro_batches(indices: Sequence[int], seqlens: Sequence[int], max_tokens: int,
                                packed: bool = False) -> list[list[int]]:
    """Cut one share into micro-batches of similar lengths, longest first.

    Each micro-batch is padded to its longest sequence, so neighbours in length order go
    together and the padded size (count x longest) stays within ``max_tokens``; ``packed``
    micro-batches hold their sequences back to back, so their real tokens count instead.
    """
    batches: list[list[int]] = []
    current: list[int] = []
    size = 0
    for index in sorted(indices, key=lambda i: (-seqlens[i], i)):
        grown = size + seqlens[index] if packed else (len(current) + 1) * seqlens[current[0] if current else index]
        if current and grown > max_tokens:
            batches.append(current)
            current, size = [], 0
        current.append(index)
        size += seqlens[index]
    if current:
        batches.append(current)
    return batches


def micro_batch_plan(seqlens: Sequence[int], dp_size: int, max_tokens: int,
                     packed: bool = False) -> list[list[list[int]]]:
    """Every rank's micro-batches (index lists), the same number on every rank.

    Tokens are balanced across ranks first (``rank_shares``); each share is then cut into
    length-sorted micro-batches (``length_sorted_micro_batches``). A rank with fewer micro-batches
    than the others splits its biggest ones in half (still length-sorted) until the counts match,
    and runs empty stand-ins only when it has fewer sequences than micro-batches.
    """
    lengths = [int(length) for length in seqlens]
    if not lengths:
        raise ValueError("the micro-batch plan got no sequences; the minibatch is empty")
    if max_tokens < 1:
        raise ValueError(f"need max_tokens >= 1, got {max_tokens}")
    if min(lengths) < 0:
        raise ValueError(f"sequence lengths must be >= 0, got {min(lengths)}")
    if max(lengths) > max_tokens:
        raise ValueError(f"a sequence of {max(lengths)} tokens exceeds max_tokens={max_tokens} per micro-batch; "
                         f"raise max_tokens to at least {max(lengths)} or shorten the sequences")
    plan = [length_sorted_micro_batches(share, lengths, max_tokens, packed) for share in rank_shares(lengths, dp_size)]
    count = max(len(batches) for batches in plan)
    for batches in plan:
        while len(batches) < count:
            biggest = max(range(len(batches)), key=lambda b: len(batches[b]) * _longest(batches[b], lengths),
                          default=None)
            if biggest is None or len(batches[biggest]) < 2:
                batches.append([])  # fewer sequences than micro-batches: a stand-in (see with_stand_ins)
                continue
            half = len(batches[biggest]) // 2
            batches[biggest:biggest + 1] = [batches[biggest][:half], batches[biggest][half:]]
    return plan


def _longest(indices: list[int], lengths: list[int]) -> int:
    return max((lengths[i] for i in indices), default=0)


def minibatch_indices(batch_size: int, nminibatches: int, generator: torch.Generator | None = None) -> list[list[int]]:
    """One epoch's shuffle: a fresh permutation of the batch cut into ``nminibatches`` parts, equal
    when the batch divides evenly, else differing by at most one (a batch short of failed trajectories)."""
    if nminibatches < 1 or batch_size < nminibatches:
        raise ValueError(f"batch_size={batch_size} cannot be cut into nminibatches={nminibatches}; "
                         "pick nminibatches between 1 and the batch size")
    order = torch.randperm(batch_size, generator=generator)
    return [part.tolist() for part in order.tensor_split(nminibatches)]


def micro_batches_for_rank(lengths: Sequence[int], rank: int, dp_size: int, max_tokens: int,
                           packed: bool = False) -> list[list[int]]:
    """This rank's micro-batches (index lists): token-balanced across ranks, length-sorted within
    the rank, the same count on every rank (see ``micro_batch_plan``)."""
    if not 0 <= rank < dp_size:
        raise ValueError(f"rank {rank} is outside [0, dp_size={dp_size})")
    return micro_batch_plan(lengths, dp_size, max_tokens, packed)[rank]


def with_stand_ins(micro_batches: list[list[int]]) -> list[tuple[list[int], bool]]:
    """``(indices, real)`` per micro-batch. FSDP forwards are collectives, so a rank runs every one
    of its micro-batches even when a partition came out empty (fewer items than partitions):
    that one stands in with item 0 and must contribute nothing (``real`` is False)."""
    return [(indices or [0], bool(indices)) for indices in micro_batches]
