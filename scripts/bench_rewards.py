"""How long the shipped math checker takes on one GSM8K-sized step, the way the job runs it.

    python scripts/bench_rewards.py [--completions 512] [--processes 2]

512 GSM8K-style completions (a worked solution ending in `#### N`, 8 per problem, a third of
them wrong) scored by `answer_reward` through `RewardFunctions`, all at once as the rollout
does: in worker processes (the job's default, `reward.fn_processes`) and, side by side, in a
thread pool of the same size. The first batch includes the workers' start and imports (once per
job); later batches are what every step pays. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rl_core.rewards import RewardFunctions  # noqa: E402
from rl_core.rewards.processes import ProcessExecutor  # noqa: E402


def gsm8k_batch(count: int, seed: int = 0) -> list[tuple[str, dict]]:
    rng = random.Random(seed)
    batch = []
    for problem in range(count // 8):
        a, b, c = rng.randint(10, 900), rng.randint(2, 40), rng.randint(1, 99)
        total = a * b + c
        reference = f"Each box holds {a} and there are {b} boxes: {a}*{b} = <<{a}*{b}={a * b}>>{a * b}.\n" \
                    f"Adding {c} more gives {a * b}+{c} = <<{a * b}+{c}={total}>>{total}.\n#### {total:,}"
        for sample in range(8):
            stated = total if sample % 3 else total + rng.randint(1, 9)
            completion = (f"There are {b} boxes with {a} each, so {a} x {b} = {a * b}. Then {a * b} + {c} = "
                          f"{stated}.\n#### {stated}")
            batch.append((completion, {"answer": reference}))
    return batch


def time_batch(fns: RewardFunctions, batch) -> tuple[float, float]:
    async def run():
        return await asyncio.gather(*(fns.score(completion, sample) for completion, sample in batch))
    started = time.perf_counter()
    scores = asyncio.run(run())
    return time.perf_counter() - started, sum(s["correct"] for s in scores) / len(scores)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--completions", type=int, default=512)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    batch = gsm8k_batch(args.completions)
    specs = {"correct": {"fn": "rl_core.rewards.math:answer_reward"}}
    results = {}
    for kind, executor in (("processes", ProcessExecutor(args.processes)),
                           ("threads", ThreadPoolExecutor(args.processes))):
        fns = RewardFunctions.from_config(specs, timeout_s=60.0, executor=executor)
        try:
            first, accuracy = time_batch(fns, batch)
            steady = sorted(time_batch(fns, batch)[0] for _ in range(args.repeats))[args.repeats // 2]
        finally:
            executor.shutdown(wait=True)
        results[kind] = {"first_s": first, "steady_s": steady, "accuracy": accuracy}
        print(f"{kind:9s} x{args.processes}: {len(batch)} completions in {steady:.2f} s per step "
              f"({1000 * steady / len(batch):.2f} ms each; first batch with start-up {first:.2f} s), "
              f"accuracy {accuracy:.3f}", flush=True)
    print(json.dumps({"completions": len(batch), "reward_step_s": round(results["processes"]["steady_s"], 3),
                      "reward_first_step_s": round(results["processes"]["first_s"], 3),
                      "threads_vs_processes": round(results["threads"]["steady_s"] / results["processes"]["steady_s"], 2),
                      "accuracy": results["processes"]["accuracy"]}))


if __name__ == "__main__":
    main()
