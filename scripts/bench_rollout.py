"""Rollout speed, measured side by side: the engine against plain `generate`, the router against static sharding.

    python scripts/bench_rollout.py [--model tiny|gpt2-86m|DIR] [--device cpu|cuda] [--engine embedded|sglang]
                                    [--concurrency 1,64,256] [--threads 1] [--skip-router]

1. Engine vs generate. One engine behind sglang-router gets `c` concurrent `/generate` requests
   (one prompt each, as the rollout sends them: 64-token prompts, 48 sampled tokens at T=0.7,
   `ignore_eos`); the same model, dtype, device and torch thread count then runs one plain
   `model.generate` of the same `c` prompts to the same fixed length. Rounds alternate between
   the two so machine load hits both alike; figures are medians. `engine_vs_generate_cN` is
   generate's time over the engine's (>= 1: the engine is at least as fast). The engine's side
   includes HTTP, JSON, the router, logprobs and continuous batching; generate returns ids only.
2. Router vs static sharding, with two embedded engines and a small model (CPU only). Engine i
   runs on core i only (`--no-pin-engines` to share), as each rank's engine owns its GPU: a
   core an idle engine leaves is not lent to the other engine.
   - `longtail`: lognormal response lengths (a few much longer than the rest), engines with
     room for every request they get, 64 in flight; the job's router (cache_aware, default
     balance thresholds) against static equal shares.
   - `skewed`: longer long-tailed responses (median 50 tokens), engines of unequal speed
     (batch capacities 16 and 4, as when one GPU has less free memory for its KV cache) and
     twice as many requests in flight as both can run (40), so each engine's static share (20
     in flight) is above its capacity: the slow one works through its queue while the fast
     one idles. `router_vs_static_skewed`: the router
     with balance thresholds (0, 1.0), i.e. each request to the engine with the fewest in
     flight; `default_router_vs_static_skewed`: the job's router (default thresholds 64, 1.5,
     below which cache_aware spreads requests by its prefix trees).
   Static shares are fixed and equal up front (every n-th request), each with its share of
   the in-flight limit.

`--model gpt2-86m` is a random-init 86M GPT-2 (12 layers, width 768) on the tiny tokenizer;
`--engine sglang --device cuda` runs part 1 against a real SGLang server (GPU machine with the
`sglang` extra; pass server flags with `--sglang-args '{"attention_backend": "triton"}'`).
The last line is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.engines.client import EngineClient  # noqa: E402
from workers.engines.launch import start_engine  # noqa: E402
from workers.engines.spec import EngineSpec  # noqa: E402
from workers.procs import ManagedProcesses  # noqa: E402
from workers.router import RouterSettings, launch_router  # noqa: E402

from bench_train import SGLANG_ARGS  # noqa: E402  (this script's folder is on sys.path)

CORPUS = ["the old man walked to the market and felt happy.", "she smiled at the bright morning sun.",
          "the dark room was cold and sad.", "a terrible storm broke the quiet night."] * 30


# ---------------------------------------------------------------- models


def bench_model(name: str, workdir: Path, context: int) -> str:
    """A model directory: the tiny assets policy, a random-init 86M GPT-2, or a given path."""
    from offline.assets import count_parameters, ensure_tiny_assets, init_tiny_gpt2
    from workers.loading import load_tokenizer

    if name not in ("tiny", "gpt2-86m"):
        return name
    policy_dir = ensure_tiny_assets().model_dir
    if name == "tiny":
        return str(policy_dir)
    tokenizer = load_tokenizer(str(policy_dir))
    model = init_tiny_gpt2(tokenizer, n_layer=12, n_embd=768, n_head=12, n_positions=context)
    print(f"gpt2-86m: {count_parameters(model) / 1e6:.1f}M parameters, vocab {len(tokenizer)}")
    out = workdir / "gpt2-86m"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def router_model(workdir: Path, context: int) -> str:
    """A 2-layer, width-64 GPT-2 with its own 300-token vocabulary: decode steps are cheap, so the
    router comparison measures scheduling, not the model."""
    from offline.assets import init_tiny_gpt2, train_tokenizer

    out = workdir / "router_model"
    tokenizer = train_tokenizer(CORPUS, out, vocab_size=300)
    init_tiny_gpt2(tokenizer, n_layer=2, n_embd=64, n_head=2, n_positions=context).save_pretrained(out)
    return str(out)


def launch_engine(spec: EngineSpec, log_path: Path, procs: ManagedProcesses, core: int | None = None) -> str:
    """Start an engine and wait for /health; with `core`, every thread of it runs on that CPU only."""
    engine = start_engine(spec, log_path, procs, deadline_s=600)
    if core is not None:  # threads started later inherit it
        for task in Path(f"/proc/{engine.proc.pid}/task").iterdir():
            os.sched_setaffinity(int(task.name), {core})
    return engine.url


# ---------------------------------------------------------------- part 1: engine vs generate


def prompts_for(batch: int, prompt_len: int, vocab: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(5, vocab - 1, (batch, prompt_len), generator=generator)


def generate_seconds(model, prompts: torch.Tensor, new_tokens: int, temperature: float) -> float:
    """One plain `model.generate` of every prompt to exactly `new_tokens` sampled tokens."""
    device = next(model.parameters()).device
    ids = prompts.to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=temperature,
                             top_k=0, top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=0, pad_token_id=0)
    sync()
    seconds = time.perf_counter() - started
    assert out.shape[1] == ids.shape[1] + new_tokens, "generate stopped early: EOS must be off"
    return seconds


async def engine_seconds(client: EngineClient, prompts: torch.Tensor, new_tokens: int, temperature: float) -> float:
    """All prompts as concurrent single-prompt /generate calls, with logprobs, as the rollout sends them."""
    params = {"max_new_tokens": new_tokens, "temperature": temperature, "ignore_eos": True}
    started = time.perf_counter()
    replies = await asyncio.gather(*(client.generate(p, params) for p in prompts.tolist()))
    seconds = time.perf_counter() - started
    assert all(len(r["output_ids"]) == new_tokens for r in replies)
    return seconds


def engine_vs_generate(args, workdir: Path, procs: ManagedProcesses) -> dict:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    model_path = bench_model(args.model, workdir, context=args.prompt_len + args.new_tokens)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, args.dtype)).to(args.device).eval()
    model.generation_config.eos_token_id = None  # fixed length, like ignore_eos
    spec = EngineSpec(kind=args.engine, model_path=model_path, dtype=args.dtype, device=args.device,
                      max_batch_size=max(args.concurrency), num_threads=args.threads,
                      mem_fraction_static=0.4, sglang_args=json.loads(args.sglang_args),
                      gpu_ids=(0,) if args.device.startswith("cuda") else None)
    engine_url = launch_engine(spec, workdir / "engine.log", procs)
    router = launch_router("127.0.0.1", None, [engine_url], workdir / "router.log", processes=procs)
    print(f"\n1. engine ({args.engine}) vs generate: {args.model}, {args.device}, {args.dtype}, "
          f"{args.threads} torch thread(s) each, {args.prompt_len}-token prompts, {args.new_tokens} tokens, "
          f"T={args.temperature}, one engine behind the router")
    results = {}

    async def run() -> None:
        async with EngineClient(router.url, timeout_s=1800) as client:
            for concurrency in args.concurrency:
                prompts = prompts_for(concurrency, args.prompt_len, model.config.vocab_size)
                rounds = args.rounds if concurrency > 1 else 3 * args.rounds
                gen, eng = [], []
                for round_ in range(rounds + 1):  # round 0 warms both up
                    g = generate_seconds(model, prompts, args.new_tokens, args.temperature)
                    e = await engine_seconds(client, prompts, args.new_tokens, args.temperature)
                    if round_:
                        gen.append(g)
                        eng.append(e)
                g, e = statistics.median(gen), statistics.median(eng)
                tokens = concurrency * args.new_tokens
                results[concurrency] = {"generate_s": g, "engine_s": e, "ratio": g / e}
                print(f"  c={concurrency:<4d} generate {g:7.3f}s ({tokens / g:8.0f} tok/s)   engine {e:7.3f}s "
                      f"({tokens / e:8.0f} tok/s)   engine/generate speed {g / e:.2f}x")

    asyncio.run(run())
    procs.stop_all("part 1 done")
    out = {f"engine_vs_generate_c{c}": round(r["ratio"], 3) for c, r in results.items()}
    out.update({f"generate_s_c{c}": round(r["generate_s"], 4) for c, r in results.items()})
    out.update({f"engine_s_c{c}": round(r["engine_s"], 4) for c, r in results.items()})
    return out


# ---------------------------------------------------------------- part 2: router vs static


def make_workload(num_requests: int, max_tokens: int, seed: int, log_median: float = 3.2) -> list[tuple[list[int], int]]:
    """Short prompts and lognormal response lengths (median e^log_median tokens, a long tail up to max_tokens)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(mean=log_median, sigma=0.9, size=num_requests), 2, max_tokens).astype(int)
    prompts = [rng.integers(2, 250, size=int(rng.integers(4, 12))).tolist() for _ in range(num_requests)]
    return list(zip(prompts, lengths.tolist()))


async def run_requests(url: str, workload, concurrency: int) -> tuple[float, int]:
    """Send `workload` to `url` with at most `concurrency` in flight; return (seconds, tokens)."""
    limit = asyncio.Semaphore(concurrency)
    async with EngineClient(url, timeout_s=1800) as client:
        async def one(prompt, length):
            async with limit:
                reply = await client.generate(prompt, {"max_new_tokens": length, "ignore_eos": True})
                return len(reply["output_ids"])
        started = time.perf_counter()
        tokens = await asyncio.gather(*(one(p, n) for p, n in workload))
        return time.perf_counter() - started, sum(tokens)


async def static_seconds(urls: list[str], workload, concurrency: int) -> float:
    """Each engine gets a fixed, equal share up front (every n-th request) and its share of the in-flight limit."""
    shares = [workload[i::len(urls)] for i in range(len(urls))]
    started = time.perf_counter()
    await asyncio.gather(*(run_requests(url, share, max(1, concurrency // len(urls)))
                           for url, share in zip(urls, shares)))
    return time.perf_counter() - started


async def mean_latency_ms(url: str, repeats: int) -> float:
    async with EngineClient(url) as client:
        started = time.perf_counter()
        for i in range(repeats):
            await client.generate([5 + i % 50, 6], {"max_new_tokens": 1})
        return (time.perf_counter() - started) / repeats * 1000


def router_vs_static(name: str, capacities: list[int], concurrency: int, args, model_path: str, workdir: Path,
                     procs: ManagedProcesses, balances: dict[str, tuple[int, float] | None],
                     log_median: float = 3.2) -> dict:
    """Makespan of the workload through the router (one router per `balances` entry) and in static shares."""
    threads = max(1, (os.cpu_count() or 1) // len(capacities))
    cores = sorted(os.sched_getaffinity(0))
    urls = [launch_engine(EngineSpec(kind="embedded", model_path=model_path, dtype="float32", device="cpu",
                                     max_batch_size=capacity, num_threads=threads, seed=i),
                          workdir / f"{name}_engine{i}.log", procs,
                          core=cores[i % len(cores)] if args.pin_engines else None)
            for i, capacity in enumerate(capacities)]
    routers = {label: launch_router("127.0.0.1", None, urls, workdir / f"{name}_{label}_router.log",
                                    RouterSettings(policy="cache_aware", balance=balance), processes=procs)
               for label, balance in balances.items()}
    workload = make_workload(args.requests, args.max_tokens, args.seed, log_median)

    async def run() -> dict:
        first = next(iter(routers.values())).url
        await run_requests(first, workload[: 4 * len(urls)], 8)  # warm-up
        direct_ms, routed_ms = await mean_latency_ms(urls[0], 40), await mean_latency_ms(first, 40)
        seconds: dict[str, list[float]] = {label: [] for label in [*routers, "static"]}
        for _ in range(args.router_rounds):  # alternate, so load drift hits all alike
            for label, router in routers.items():
                seconds[label].append((await run_requests(router.url, workload, concurrency))[0])
            seconds["static"].append(await static_seconds(urls, workload, concurrency))
        return {"seconds": {label: statistics.median(values) for label, values in seconds.items()},
                "router_overhead_ms": routed_ms - direct_ms}

    result = asyncio.run(run())
    procs.stop_all(f"{name} done")
    static_s = result["seconds"]["static"]
    line = "   ".join(f"{label} {s:.2f}s" for label, s in result["seconds"].items())
    print(f"  {name:9s} engine capacities {capacities}, {concurrency} in flight: {line}")
    for label in routers:
        print(f"  {'':9s} router ({label}) / static speed {static_s / result['seconds'][label]:.2f}x")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="tiny | gpt2-86m | a model directory")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--engine", default="embedded", choices=["embedded", "sglang"])
    parser.add_argument("--sglang-args", default=json.dumps(SGLANG_ARGS),
                        help="JSON object of extra SGLang ServerArgs (default: what SGLang 0.5.17 needs for "
                             "the tiny-tokenizer GPT-2, as in bench_train.py)")
    parser.add_argument("--concurrency", default="1,64,256", help="comma-separated request counts")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads for generate and for the engine (1: the engine and the "
                             "benchmark client do not fight over 2 cores)")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds per concurrency (x3 at c=1)")
    parser.add_argument("--skip-router", action="store_true", help="only part 1")
    parser.add_argument("--skip-generate", action="store_true", help="only part 2")
    parser.add_argument("--requests", type=int, default=256, help="part 2: requests per run")
    parser.add_argument("--rollout-concurrency", type=int, default=64, help="part 2: requests in flight (num_envs)")
    parser.add_argument("--max-tokens", type=int, default=400, help="part 2: longest response")
    parser.add_argument("--router-rounds", type=int, default=3)
    parser.add_argument("--skewed-capacities", default="16,4", help="part 2 skewed: batch capacity per engine")
    parser.add_argument("--no-pin-engines", dest="pin_engines", action="store_false",
                        help="part 2: let engines share every core (by default engine i runs on core i only, "
                             "as each rank's engine owns its GPU: an idle engine's core is not lent to the other)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    summary: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench_rollout_") as tmp, ManagedProcesses() as procs:
        workdir = Path(tmp)
        if not args.skip_generate:
            summary.update(engine_vs_generate(args, workdir, procs))
        if not args.skip_router:
            placement = "each on its own core" if args.pin_engines else "sharing every core"
            print(f"\n2. router vs static sharding: {args.requests} requests, lognormal lengths up to "
                  f"{args.max_tokens}, 2 embedded engines, {placement}")
            model_path = router_model(workdir, context=args.max_tokens + 64)
            default, shortest = "default thresholds", "least loaded"
            longtail = router_vs_static("longtail", [args.rollout_concurrency] * 2, args.rollout_concurrency, args,
                                        model_path, workdir, procs, {default: None})
            capacities = [int(c) for c in args.skewed_capacities.split(",")]
            skewed = router_vs_static("skewed", capacities, 2 * sum(capacities), args, model_path, workdir, procs,
                                      {shortest: (0, 1.0), default: None}, log_median=3.9)
            seconds = {"longtail": longtail["seconds"], "skewed": skewed["seconds"]}
            summary.update({
                "router_vs_static_longtail": round(seconds["longtail"]["static"] / seconds["longtail"][default], 3),
                "router_vs_static_skewed": round(seconds["skewed"]["static"] / seconds["skewed"][shortest], 3),
                "default_router_vs_static_skewed": round(seconds["skewed"]["static"] / seconds["skewed"][default], 3),
                "router_overhead_ms": round(longtail["router_overhead_ms"], 3),
                **{f"{name}_{label.replace(' ', '_')}_s": round(value, 3)
                   for name, by_label in seconds.items() for label, value in by_label.items()}})
    summary["load_average"] = round(os.getloadavg()[0], 2)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
