"""A GPU rank's host-side bookkeeping under torch's CPU threads, with a busy process beside it, side by side.

    python scripts/bench_host_threads.py [--repeats 20] [--threads N]

What a GPU rank does on the CPU for each forward pass of a gpu86m step (scripts/bench_vs_trl.py: 32 prompts x 8
completions of 64 + 48 tokens, packed rows with each group's prompt once): the batch worker plans its
micro-batches (`workers.worker.BatchWorker.plan`: prompt groups, balancing) and selects and packs each one
(`micro_batch`: index, trim, `layout.pack`) before it goes to the device. Here the device is the CPU, so the
timings are the host part alone. Three runs of the same work:

- `all threads, idle`: torch's threads on every core (`--threads`, default all), nothing else running;
- `all threads, busy neighbour`: the same beside one process that spins on a core, as SGLang's scheduler does
  while idle unless `sleep_on_idle` is set;
- `1 thread, busy neighbour`: what a GPU rank now runs with (`PPORuntime.trainer_threads`).

On an H200 (2026-11-27) torch's 16 threads beside SGLang's scheduler made these ops take 6-8 ms each, about a
second of a 3 s step. The last line is one JSON object; `stall_ratio` is the second run's time over the third's.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PROMPTS, GROUP, PROMPT_TOKENS, RESPONSE_TOKENS, VOCAB = 32, 8, 64, 48, 1360


def gpu86m_batch(seed: int = 0):
    """The step's `[N, T]` batch as the PPO job builds it: each group's 8 rows share their prompt."""
    import torch

    from workers.layout import rows_to_batch

    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(PROMPTS):
        prompt = torch.randint(3, VOCAB, (PROMPT_TOKENS,), generator=generator).tolist()
        for _ in range(GROUP):
            response = torch.randint(3, VOCAB, (RESPONSE_TOKENS,), generator=generator).tolist()
            per_token = {key: torch.randn(PROMPT_TOKENS + RESPONSE_TOKENS, generator=generator).tolist()
                         for key in ("old_logprobs", "ref_logprobs", "advantages")}
            rows.append({"input_ids": prompt + response,
                         "action_mask": [0] * PROMPT_TOKENS + [1] * RESPONSE_TOKENS, **per_token})
    return rows_to_batch(rows, pad_token_id=0)


def spin(stop, parent: int) -> None:
    while not stop.is_set() and os.getppid() == parent:  # ends with its parent however that one ends
        pass


def host_pass_ms(threads: int, repeats: int, neighbour: bool) -> float:
    """Median ms of one forward pass's host work (plan, then every micro-batch laid out)."""
    import torch

    from workers.worker import BatchWorker

    torch.set_num_threads(threads)
    batch = gpu86m_batch()
    # 2 minibatches of 128 rows, as the train phase runs them; the job's default micro-batch budget
    worker = BatchWorker(0, 1, torch.device("cpu"), max_tokens=8192, layout="rows", share_prompts=True)
    halves = [{key: value[:128] for key, value in batch.items()}, {key: value[128:] for key, value in batch.items()}]
    stop = multiprocessing.Event()
    spinner = multiprocessing.Process(target=spin, args=(stop, os.getpid()), daemon=True) if neighbour else None
    if spinner is not None:
        spinner.start()
        time.sleep(0.2)
    try:
        times = []
        for repeat in range(repeats + 2):
            started = time.perf_counter()
            for half in halves:
                worker.micro_batches(half)
            if repeat >= 2:  # the first two warm the allocator and caches
                times.append((time.perf_counter() - started) * 1e3)
    finally:
        if spinner is not None:
            stop.set()
            spinner.join(5)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch's threads (all cores)")
    args = parser.parse_args()
    runs = {
        f"{args.threads} threads, idle": host_pass_ms(args.threads, args.repeats, neighbour=False),
        f"{args.threads} threads, busy neighbour": host_pass_ms(args.threads, args.repeats, neighbour=True),
        "1 thread, busy neighbour": host_pass_ms(1, args.repeats, neighbour=True),
    }
    for name, ms in runs.items():
        print(f"{name:32s} {ms:8.2f} ms per pass (plan + micro-batches of 2 x 128 rows)")
    busy, one = runs[f"{args.threads} threads, busy neighbour"], runs["1 thread, busy neighbour"]
    print(json.dumps({"threads": args.threads, "ms": runs, "stall_ratio": busy / one}))


if __name__ == "__main__":
    main()
