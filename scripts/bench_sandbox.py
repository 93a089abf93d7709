"""What the tool sandbox costs: `--calls` calls of a trivial program, `--concurrency` at a time, through
`envs.sandbox.Sandbox` (a private root with bubblewrap, a cgroup per call where the host allows) and, side by
side in the same run, as a bare `python -I -c` subprocess with no isolation at all. Prints seconds per call
for both, their ratio (the isolation's overhead), the calls per second, and the longest stall of a 20 ms
ticker on the same event loop (the loop must stay free while calls start and end). The last line is one
JSON object.

    python scripts/bench_sandbox.py [--calls 64] [--concurrency 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from envs.sandbox import Sandbox, SandboxLimits

PROGRAM = "print(sum(range(1000)))"


async def bare(python: str, slots: asyncio.Semaphore) -> str:
    async with slots:
        proc = await asyncio.create_subprocess_exec(python, "-I", "-c", PROGRAM, stdout=asyncio.subprocess.PIPE,
                                                    stdin=asyncio.subprocess.DEVNULL)
        out, _ = await proc.communicate()
        return out.decode()


async def timed(calls) -> tuple[float, float, list[str]]:
    """Seconds for all `calls` and the longest gap of a 20 ms ticker meanwhile."""
    gaps, done = [], False

    async def ticker():
        last = time.monotonic()
        while not done:
            await asyncio.sleep(0.02)
            now = time.monotonic()
            gaps.append(now - last - 0.02)
            last = now

    tick = asyncio.create_task(ticker())
    started = time.monotonic()
    outputs = await asyncio.gather(*calls)
    seconds = time.monotonic() - started
    done = True
    await tick
    return seconds, max(gaps, default=0.0), outputs


async def main(args) -> dict:
    sandbox = Sandbox(args.concurrency, SandboxLimits(timeout_s=30.0))
    print(sandbox.enforced, flush=True)
    expected = f"{sum(range(1000))}\n"
    sides: dict[str, list[tuple[float, float]]] = {"sandbox": [], "bare": []}
    for _ in range(args.rounds):  # alternated, so both sides see the same machine
        slots = asyncio.Semaphore(args.concurrency)
        seconds, gap, outputs = await timed([bare(sandbox.python, slots) for _ in range(args.calls)])
        assert outputs == [expected] * args.calls, outputs[:2]
        sides["bare"].append((seconds, gap))
        seconds, gap, results = await timed([sandbox.run_python(PROGRAM) for _ in range(args.calls)])
        assert [r.stdout for r in results] == [expected] * args.calls, results[:2]
        sides["sandbox"].append((seconds, gap))
    best = {side: min(s for s, _ in runs) for side, runs in sides.items()}
    out = {"calls": args.calls, "concurrency": args.concurrency,
           "sandbox_s_per_call": best["sandbox"] / args.calls, "bare_s_per_call": best["bare"] / args.calls,
           "overhead_ratio": best["sandbox"] / best["bare"], "sandbox_calls_per_s": args.calls / best["sandbox"],
           "sandbox_max_loop_stall_s": max(g for _, g in sides["sandbox"]),
           "bare_max_loop_stall_s": max(g for _, g in sides["bare"])}
    print(f"{args.calls} calls, {args.concurrency} at a time (best of {args.rounds}): sandbox "
          f"{out['sandbox_s_per_call'] * 1000:.1f} ms per call ({out['sandbox_calls_per_s']:.0f}/s), bare subprocess "
          f"{out['bare_s_per_call'] * 1000:.1f} ms: {out['overhead_ratio']:.2f}x; longest event-loop stall "
          f"{out['sandbox_max_loop_stall_s'] * 1000:.0f} ms (bare {out['bare_max_loop_stall_s'] * 1000:.0f} ms)")
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    result = asyncio.run(main(parser.parse_args()))
    print(json.dumps(result))
