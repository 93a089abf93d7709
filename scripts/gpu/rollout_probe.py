"""Where a rollout's time goes inside one engine: the gpu86m batch sent straight to an engine in several
shapes, beside transformers' `generate` (what TRL runs) doing the same work on the same device.

    python scripts/gpu/rollout_probe.py --workdir /tmp/gpu86m [--size 86m] [--engine sglang] [--repeats 3]

The workdir is `scripts/bench_vs_trl.py --setting gpu86m`'s (its `policy-<size>/` and `prompts.jsonl`).
Every shape generates the same tokens: `--prompts` prompts x `--group-size` samples x `--response-length`
tokens (ignore_eos, as the job's gpu86m recipe). Each is sent once to warm up, then `--repeats` times; the
median seconds are printed, with what each says:

    job          `--prompts` calls with n = group size and logprobs, through sglang-router (the job's rollout)
    direct       the same calls, straight to the engine (job - direct: the router's share)
    no_logprob   direct without return_logprob (the cost of the logprobs the trainer reads)
    single       one call per sequence, n = 1 (the cost or gain of SGLang's n-expansion)
    one_call     one call with every sequence as a row of input_ids
    first_token  direct with max_new_tokens = 1: admission and prefill; (direct - first_token) / (length - 1)
                 is one decode step of the whole batch
    two_batches  direct for two batches at once (twice the sequences, twice the tokens): whether a producer
                 that keeps two batches in flight would get more from the engine than one batch at a time
    generate     transformers' model.generate on the same device and dtype, sampling the same shape

With `--pyspy PY_SPY --pyspy-out FILE`, `direct` is then sent again for `--pyspy-s` seconds while py-spy records
the engine server and its subprocesses (SGLang's scheduler and detokenizer): raw stacks with counts, one line each,
where the engine's own time goes (not timed: py-spy slows what it samples).

The last line is one JSON object. On a GPU, `bash scripts/gpu/run.sh` runs this after the benchmark.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

SHAPES = ("job", "direct", "no_logprob", "single", "one_call", "first_token", "two_batches")


def load_prompts(workdir: Path, size: str, count: int) -> tuple[Path, list[list[int]]]:
    from workers.loading import load_tokenizer

    policy = workdir / f"policy-{size}"
    tokenizer = load_tokenizer(str(policy))
    rows = [json.loads(line)["prompt"] for line in (workdir / "prompts.jsonl").read_text().splitlines()][:count]
    if len(rows) < count:
        raise SystemExit(f"{workdir / 'prompts.jsonl'} has {len(rows)} prompts, --prompts asks for {count}")
    return policy, [tokenizer(text, add_special_tokens=False)["input_ids"] for text in rows]


async def send(shape: str, engine, router, prompts: list[list[int]], args) -> int:
    """One rollout in `shape`; returns the tokens it generated."""
    params = {"temperature": args.temperature, "top_p": 1.0, "max_new_tokens": args.response_length, "ignore_eos": True}
    if shape == "first_token":
        params["max_new_tokens"] = 1
    client = router if shape == "job" else engine
    grouped = dict(params, n=args.group_size)
    logprobs = shape != "no_logprob"
    if shape == "two_batches":
        prompts = prompts + prompts
    if shape in ("job", "direct", "no_logprob", "first_token", "two_batches"):
        answers = await asyncio.gather(*(client.generate(ids, grouped, return_logprob=logprobs) for ids in prompts))
        outputs = [out for group in answers for out in (group if isinstance(group, list) else [group])]
    elif shape == "single":
        outputs = await asyncio.gather(*(client.generate(ids, params) for ids in prompts
                                         for _ in range(args.group_size)))
    else:  # one_call
        outputs = await client.generate([ids for ids in prompts for _ in range(args.group_size)], params)
    return sum(len(out["output_ids"]) for out in outputs)


async def profile_direct(engine_url: str, engine_pid: int, prompts: list[list[int]], args) -> int:
    """`direct` sent again and again while py-spy records the server's processes; the rollouts sent."""
    from workers.engines.client import EngineClient

    recorder = subprocess.Popen([args.pyspy, "record", "--subprocesses", "--nonblocking", "--rate", "100",
                                 "--duration", str(args.pyspy_s), "--format", "raw", "--output", str(args.pyspy_out),
                                 "--pid", str(engine_pid)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    sent = 0
    async with EngineClient(engine_url) as engine:
        while recorder.poll() is None:
            await send("direct", engine, None, prompts, args)
            sent += 1
    print(f"py-spy recorded the engine during {sent} direct rollouts: {args.pyspy_out} (exit {recorder.returncode})",
          flush=True)
    return sent


async def time_shapes(engine_url: str, router_url: str, prompts: list[list[int]], args) -> dict:
    from workers.engines.client import EngineClient

    results = {}
    async with EngineClient(engine_url) as engine, EngineClient(router_url, label="router") as router:
        for _ in range(2):  # the engine's first batches are slower (memory, kernels, graphs): not any shape's cost
            await send("direct", engine, router, prompts, args)
        for shape in args.shapes:
            tokens, seconds = 0, []
            for attempt in range(args.repeats + 1):  # the first warms up (a new batch size, a CUDA graph)
                started = time.perf_counter()
                tokens = await send(shape, engine, router, prompts, args)
                if attempt:
                    seconds.append(time.perf_counter() - started)
            results[shape] = {"median_s": statistics.median(seconds), "min_s": min(seconds), "tokens": tokens}
            print(f"{shape:12s} median {results[shape]['median_s']:.3f} s (min {min(seconds):.3f}), "
                  f"{tokens} tokens", flush=True)
    return results


def time_generate(policy: Path, prompts: list[list[int]], args, device: str, dtype: str) -> dict:
    """transformers' generate on the same rows (each prompt group_size times), sampled, exactly length tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(policy, dtype=getattr(torch, dtype)).to(device).eval()
    rows = torch.tensor([ids for ids in prompts for _ in range(args.group_size)], device=device)  # equal lengths
    seconds, tokens = [], 0
    for attempt in range(args.repeats + 1):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        started = time.perf_counter()
        with torch.no_grad():
            out = model.generate(rows, attention_mask=torch.ones_like(rows), do_sample=True, temperature=args.temperature,
                                 top_k=0, top_p=1.0, max_new_tokens=args.response_length,
                                 min_new_tokens=args.response_length, pad_token_id=0)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        tokens = (out.shape[1] - rows.shape[1]) * rows.shape[0]
        if attempt:
            seconds.append(time.perf_counter() - started)
    print(f"{'generate':12s} median {statistics.median(seconds):.3f} s (min {min(seconds):.3f}), {tokens} tokens",
          flush=True)
    del model
    return {"median_s": statistics.median(seconds), "min_s": min(seconds), "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--size", default="86m")
    parser.add_argument("--engine", choices=("sglang", "embedded"), default="sglang")
    parser.add_argument("--device", default=None, help="cuda:0 when a GPU is present, else cpu")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--response-length", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES))
    parser.add_argument("--no-generate", action="store_true", help="leave out transformers' generate")
    parser.add_argument("--sglang-arg", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--sglang-python", default=None, help="the server's interpreter (CPU: .venv-sglang/bin/python)")
    parser.add_argument("--pyspy", default=None, help="py-spy's path: record the engine during more direct rollouts")
    parser.add_argument("--pyspy-out", type=Path, default=Path("pyspy_engine.txt"))
    parser.add_argument("--pyspy-s", type=int, default=10)
    args = parser.parse_args()

    import torch

    from bench_vs_trl import KIT_SGLANG_ARGS
    from workers.engines.launch import start_engine
    from workers.engines.spec import EngineSpec
    from workers.procs import ManagedProcesses
    from workers.router import launch_router

    device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    policy, prompts = load_prompts(args.workdir, args.size, args.prompts)
    sglang_args = {}
    if args.engine == "sglang" and device.startswith("cuda"):  # the benchmark's flags; a CUDA graph up to two_batches
        sglang_args = dict(KIT_SGLANG_ARGS, cuda_graph_max_bs_decode=2 * args.prompts * args.group_size)
    sglang_args.update(item.split("=", 1) for item in args.sglang_arg)  # (on CPU the engine has its own defaults)
    spec = EngineSpec(kind=args.engine, model_path=str(policy), dtype=dtype, device=device,
                      max_batch_size=2 * args.prompts * args.group_size, mem_fraction_static=0.5, sglang_args=sglang_args,
                      gpu_ids=(int(device.split(":")[1]),) if device.startswith("cuda") else None,
                      sglang_python=args.sglang_python)
    procs = ManagedProcesses()
    logs = args.workdir / "rollout_probe_logs"  # beside the benchmark's outputs; each run appends to its logs
    logs.mkdir(exist_ok=True)
    try:
        started = time.perf_counter()
        engine = start_engine(spec, logs / "engine.log", procs, deadline_s=600)
        print(f"{args.engine} engine up in {time.perf_counter() - started:.0f} s (log {logs / 'engine.log'})", flush=True)
        router = launch_router("127.0.0.1", None, [engine.url], log_path=logs / "router.log", processes=procs)
        results = asyncio.run(time_shapes(engine.url, router.url, prompts, args))
        if args.pyspy:
            results["pyspy_rollouts"] = asyncio.run(profile_direct(engine.url, engine.proc.pid, prompts, args))
    finally:
        procs.stop_all("the probe is done")
    if not args.no_generate:
        results["generate"] = time_generate(policy, prompts, args, device, dtype)
    if "direct" in results and "first_token" in results and args.response_length > 1:
        step = (results["direct"]["median_s"] - results["first_token"]["median_s"]) / (args.response_length - 1)
        print(f"one decode step of {args.prompts * args.group_size} sequences: {step * 1e3:.1f} ms", flush=True)
        results["decode_step_s"] = step
    print(json.dumps({"engine": args.engine, "device": device, "dtype": dtype, "size": args.size,
                      "sequences": args.prompts * args.group_size, "response_length": args.response_length,
                      "shapes": results}))


if __name__ == "__main__":
    main()
