"""Benchmark token balancing across data-parallel ranks on long-tailed (lognormal) lengths.

Three layouts of the same sequences, with the same number of micro-batches per rank:
- equal-count: contiguous equal-count shards per rank, cut into equal-count micro-batches;
- balanced, unsorted: Karmarkar-Karp token-balanced shares, micro-batches dealt out in no
  length order (what mixing long and short sequences costs in padding);
- balanced, length-sorted (`workers.balance.micro_batch_plan`, what the trainers use).
Reports the most loaded rank over the mean (1.0 = perfect), padding waste if every micro-batch
is padded to its longest sequence, and planning time. The last line is one JSON object.

    python scripts/bench_balance.py [--num-seqs 1024] [--max-tokens 16384] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from workers.balance import micro_batch_plan

DP_SIZES = (2, 4, 8)


def lognormal_lengths(n: int, mean_tokens: float, sigma: float, cap: int, seed: int) -> list[int]:
    """Lengths with a realistic long tail: lognormal with the given mean, clipped to [1, cap]."""
    generator = torch.Generator().manual_seed(seed)
    mu = math.log(mean_tokens) - sigma**2 / 2
    samples = torch.exp(mu + sigma * torch.randn(n, generator=generator, dtype=torch.float64))
    return [min(cap, max(1, int(x))) for x in samples.tolist()]


def equal_count_micro_batches(n: int, dp_size: int, micro_batches_per_rank: int) -> list[list[list[int]]]:
    """Baseline: contiguous equal-count shards per rank, each cut into equal-count micro-batches."""
    per_rank = n // dp_size
    ranks = [list(range(r * per_rank, (r + 1) * per_rank)) for r in range(dp_size)]
    size = math.ceil(per_rank / micro_batches_per_rank)
    return [[shard[i:i + size] for i in range(0, len(shard), size)] for shard in ranks]


def load_stats(per_rank_micro_batches: list[list[list[int]]], lengths: list[int]) -> dict[str, float]:
    rank_tokens = [sum(lengths[i] for mb in rank for i in mb) for rank in per_rank_micro_batches]
    rank_padded = [sum(max(lengths[i] for i in mb) * len(mb) for mb in rank if mb) for rank in per_rank_micro_batches]
    real = sum(rank_tokens)
    return {
        "max_tokens_per_rank": max(rank_tokens),
        "mean_tokens_per_rank": real / len(rank_tokens),
        "max_over_mean": max(rank_tokens) / (real / len(rank_tokens)),
        "padded_max_over_mean": max(rank_padded) / (sum(rank_padded) / len(rank_padded)),
        "padding_waste": 1.0 - real / sum(rank_padded),
    }


def timed_plan(lengths: list[int], dp_size: int, max_tokens: int, repeats: int = 3) -> tuple[list, float]:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        plan = micro_batch_plan(lengths, dp_size, max_tokens)
        best = min(best, time.perf_counter() - start)
    return plan, best * 1000


def unsorted_like(plan: list[list[list[int]]]) -> list[list[list[int]]]:
    """The same shares and micro-batch counts, sequences dealt out in index order."""
    out = []
    for batches in plan:
        share = sorted(i for batch in batches for i in batch)
        out.append([share[j::len(batches)] for j in range(len(batches))])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-seqs", type=int, default=1024)
    parser.add_argument("--mean-tokens", type=float, default=300.0)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=16384, help="token budget per micro-batch")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    lengths = lognormal_lengths(args.num_seqs, args.mean_tokens, args.sigma, args.max_tokens, args.seed)
    print(f"{args.num_seqs} sequences, mean {sum(lengths) / len(lengths):.0f} tokens, longest {max(lengths)}, "
          f"max_tokens per micro-batch {args.max_tokens} (padded)")
    summary = {"balanced_max_over_mean": 0.0, "equal_count_max_over_mean": 0.0, "sorted_padding_waste": 0.0,
               "unsorted_padding_waste": 0.0, "equal_count_padding_waste": 0.0, "partition_ms_1024": 0.0}
    for dp_size in DP_SIZES:
        plan, elapsed_ms = timed_plan(lengths, dp_size, args.max_tokens)
        equal = equal_count_micro_batches(len(lengths), dp_size, len(plan[0]))
        layouts = (("equal-count", equal, "equal_count"), ("unsorted", unsorted_like(plan), "unsorted"),
                   ("sorted", plan, "sorted"))
        for name, layout, key in layouts:
            stats = load_stats(layout, lengths)
            print(f"dp={dp_size} {name:11s} micro-batches/rank={len(layout[0]):3d} "
                  f"max/mean tokens per rank={stats['max_tokens_per_rank']}/{stats['mean_tokens_per_rank']:.0f} "
                  f"({stats['max_over_mean']:.4f}, padded {stats['padded_max_over_mean']:.4f}) "
                  f"padding waste={stats['padding_waste']:.1%}")
            summary[f"{key}_padding_waste"] = max(summary[f"{key}_padding_waste"], stats["padding_waste"])
            if key != "unsorted":
                balance_key = "balanced_max_over_mean" if key == "sorted" else "equal_count_max_over_mean"
                summary[balance_key] = max(summary[balance_key], stats["max_over_mean"])
        print(f"dp={dp_size} planning time {elapsed_ms:.1f} ms")
        summary["partition_ms_1024"] = max(summary["partition_ms_1024"], elapsed_ms)

    big = lognormal_lengths(4096, args.mean_tokens, args.sigma, args.max_tokens, args.seed + 1)
    summary["partition_ms_4096"] = max(timed_plan(big, dp, args.max_tokens)[1] for dp in DP_SIZES)
    print(f"4096 sequences: worst planning time over dp {DP_SIZES}: {summary['partition_ms_4096']:.1f} ms")
    print(json.dumps({key: round(value, 4) for key, value in summary.items()}))


if __name__ == "__main__":
    main()
