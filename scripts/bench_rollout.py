"""Router vs static sharding on a long-tailed rollout, with embedded engines on this machine.

    python scripts/bench_rollout.py [--engines 2] [--requests 256] [--model-path DIR]

Each request asks for a lognormal number of tokens with `ignore_eos`, so a few responses are
much longer than the rest (as in RL rollouts). "router": every request goes to the router,
which picks an engine per request. "static": each engine gets a fixed equal share up front.
Both keep at most `--concurrency` requests in flight in total (the environment pool size).
The last line is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.engines.client import EngineClient  # noqa: E402
from workers.engines.embedded import launch_embedded_engine  # noqa: E402
from workers.procs import ManagedProcesses  # noqa: E402
from workers.router import launch_router  # noqa: E402

CORPUS = ["the old man walked to the market and felt happy.", "she smiled at the bright morning sun.",
          "the dark room was cold and sad.", "a terrible storm broke the quiet night."] * 30


def build_model(out_dir: Path, context: int) -> str:
    from rl_core.tiny.assets import init_tiny_gpt2, train_tokenizer

    tokenizer = train_tokenizer(CORPUS, out_dir, vocab_size=300)
    init_tiny_gpt2(tokenizer, n_layer=2, n_embd=64, n_head=2, n_positions=context).save_pretrained(out_dir)
    return str(out_dir)


def make_workload(num_requests: int, max_tokens: int, seed: int) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(mean=3.2, sigma=0.9, size=num_requests), 2, max_tokens).astype(int)
    prompts = [rng.integers(2, 250, size=int(rng.integers(4, 12))).tolist() for _ in range(num_requests)]
    return list(zip(prompts, lengths.tolist()))


async def run_requests(url: str, workload, concurrency: int) -> tuple[float, int]:
    """Send `workload` to `url` with at most `concurrency` in flight; return (seconds, tokens)."""
    limit = asyncio.Semaphore(concurrency)
    async with EngineClient(url, timeout_s=600) as client:
        async def one(prompt, length):
            async with limit:
                reply = await client.generate(prompt, {"max_new_tokens": length, "ignore_eos": True})
                return len(reply["output_ids"])
        started = time.perf_counter()
        tokens = await asyncio.gather(*(one(p, n) for p, n in workload))
        return time.perf_counter() - started, sum(tokens)


async def static_shares(urls: list[str], workload, concurrency: int) -> float:
    shares = [workload[i::len(urls)] for i in range(len(urls))]
    started = time.perf_counter()
    await asyncio.gather(*(run_requests(url, share, max(1, concurrency // len(urls)))
                           for url, share in zip(urls, shares)))
    return time.perf_counter() - started


async def tokens_per_second(url: str, concurrency: int, tokens: int, rounds: int) -> float:
    workload = [([5 + i % 50, 6, 7], tokens) for i in range(concurrency * rounds)]
    seconds, total = await run_requests(url, workload, concurrency)
    return total / seconds


async def mean_latency_ms(url: str, repeats: int) -> float:
    async with EngineClient(url) as client:
        started = time.perf_counter()
        for i in range(repeats):
            await client.generate([5 + i % 50, 6], {"max_new_tokens": 1})
        return (time.perf_counter() - started) / repeats * 1000


async def benchmark(engine_urls: list[str], router_url: str, args) -> dict:
    workload = make_workload(args.requests, args.max_tokens, args.seed)
    await run_requests(router_url, workload[: 4 * len(engine_urls)], 8)  # warm-up
    tps_c1 = await tokens_per_second(engine_urls[0], 1, 64, rounds=3)
    tps_c64 = await tokens_per_second(engine_urls[0], 64, 64, rounds=2)
    direct_ms = await mean_latency_ms(engine_urls[0], 40)
    routed_ms = await mean_latency_ms(router_url, 40)
    router_s, total_tokens = await run_requests(router_url, workload, args.concurrency)
    static_s = await static_shares(engine_urls, workload, args.concurrency)
    lengths = [n for _, n in workload]
    # Lower bound: all engines busy at full batched speed, and never less than the longest response alone.
    throughput_bound_s = total_tokens / (len(engine_urls) * tps_c64)
    ideal_s = max(throughput_bound_s, max(lengths) / tps_c1)
    return {"engines": len(engine_urls), "requests": len(workload), "total_tokens": total_tokens,
            "max_len": max(lengths), "median_len": float(np.median(lengths)),
            "router_s": round(router_s, 3), "static_s": round(static_s, 3),
            "static_over_router": round(static_s / router_s, 3), "ideal_s": round(ideal_s, 3),
            "throughput_bound_s": round(throughput_bound_s, 3),
            "router_overhead_ms": round(routed_ms - direct_ms, 3), "direct_latency_ms": round(direct_ms, 3),
            "tokens_per_s_c1": round(tps_c1, 1), "tokens_per_s_c64": round(tps_c64, 1),
            "batching_speedup": round(tps_c64 / tps_c1, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight in total (num_envs)")
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--policy", default="cache_aware")
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    threads = max(1, (os.cpu_count() or 1) // args.engines)
    with tempfile.TemporaryDirectory() as tmp, ManagedProcesses() as procs:
        tmp = Path(tmp)
        model_path = args.model_path or build_model(tmp / "model", context=args.max_tokens + 64)
        engines = [launch_embedded_engine(model_path, tmp / f"engine{i}.log", processes=procs, wait=False,
                                          num_threads=threads, seed=i) for i in range(args.engines)]
        for engine in engines:
            engine.wait_ready()
        router = launch_router("127.0.0.1", None, [e.url for e in engines], tmp / "router.log",
                               policy=args.policy, processes=procs)
        result = asyncio.run(benchmark([e.url for e in engines], router.url, args))
    print(f"{result['engines']} engines, {result['requests']} requests, {result['total_tokens']} tokens "
          f"(median {result['median_len']:.0f}, max {result['max_len']})")
    print(f"router makespan  {result['router_s']:.2f}s   static makespan {result['static_s']:.2f}s   "
          f"static/router {result['static_over_router']:.2f}   ideal {result['ideal_s']:.2f}s "
          f"(throughput bound {result['throughput_bound_s']:.2f}s)")
    print(f"router overhead  {result['router_overhead_ms']:.2f} ms/request (direct {result['direct_latency_ms']:.2f} ms)")
    print(f"engine tokens/s  c1 {result['tokens_per_s_c1']:.0f}   c64 {result['tokens_per_s_c64']:.0f}   "
          f"x{result['batching_speedup']:.1f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
