"""Weight push into the embedded engine, next to one host copy of the parameters and the old file path.

    python scripts/bench_weights.py [--models tiny,gpt2-86m] [--repeats 5] [--threads 1]

For each model (the tiny assets policy, and a random-init 86M GPT-2: 12 layers, width 768, the
tiny tokenizer), measured side by side in one run, medians over `--repeats` rounds that
alternate between the three:
- copy: one host copy of the parameters (every parameter copied into one preallocated buffer),
  the floor for moving the weights once;
- push: `RankEngine.push` into a running embedded engine, exactly as the job does it
  (`/begin_weight_update`, flattened buckets through `/update_weights_from_tensor`,
  `/end_weight_update`), until the engine's weights are the new ones;
- file: the path the job used before (one safetensors file in /dev/shm, loaded into the model),
  reimplemented here only as the comparison, without any HTTP.
`weight_push_vs_copy_<model>` is push seconds over copy seconds; `weight_push_vs_copy` the larger
of the two. The push's fixed costs (three HTTP round trips, payload pickling) are printed too:
they dominate a tiny model's push. The last line is one JSON object.
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.engines.client import EngineClient  # noqa: E402
from workers.engines.launch import start_engine  # noqa: E402
from workers.engines.spec import EngineSpec  # noqa: E402
from workers.engines.rank_engine import RankEngine  # noqa: E402
from workers.engines.weights import Probe, WeightPusher, tensor_nbytes  # noqa: E402
from workers.procs import ManagedProcesses  # noqa: E402
from bench_rollout import bench_model  # noqa: E402 - the same models as the rollout bench

PROBE = [5, 6, 7, 8, 9, 10, 11, 12]


def unique_parameters(model) -> list[tuple[str, torch.Tensor]]:
    """What the trainer sends: every parameter once (tied ones under their first name)."""
    return [(name, p.detach()) for name, p in model.named_parameters()]


def copy_seconds(named: list[tuple[str, torch.Tensor]], buffer: torch.Tensor) -> float:
    """One host copy of the parameters into a preallocated buffer."""
    started = time.perf_counter()
    offset = 0
    for _, tensor in named:
        n = tensor.numel()
        buffer[offset:offset + n].copy_(tensor.reshape(-1))
        offset += n
    return time.perf_counter() - started


def file_seconds(named: list[tuple[str, torch.Tensor]], receiver, path: Path) -> float:
    """The old path: save one safetensors file in /dev/shm, load it, copy it into the model."""
    from safetensors.torch import load_file, save_file

    started = time.perf_counter()
    save_file({name: t.contiguous() for name, t in named}, str(path))
    loaded = load_file(str(path))
    receiver.load_state_dict(loaded, strict=False)
    seconds = time.perf_counter() - started
    path.unlink()
    return seconds


def perturbed(named: list[tuple[str, torch.Tensor]], round_: int) -> None:
    """New weights every round, so no push can pass by sending nothing new."""
    with torch.no_grad():
        for _, tensor in named:
            tensor.add_(1e-4 * (round_ + 1))


def bench_one(name: str, model_path: str, args, workdir: Path, procs: ManagedProcesses) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    receiver = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    named = unique_parameters(model)
    nbytes = sum(tensor_nbytes(t) for _, t in named)
    buffer = torch.empty(sum(t.numel() for _, t in named), dtype=torch.float32)
    spec = EngineSpec("embedded", model_path, "float32", "cpu", num_threads=args.threads)
    engine = start_engine(spec, workdir / f"{name}_engine.log", procs, deadline_s=300)
    pusher = WeightPusher(torch.float32, bucket_bytes=args.bucket_mb << 20)
    copies, pushes, files, stats = [], [], [], []
    with RankEngine(engine.url, workdir / f"{name}_engine.log", pusher, 2e-3) as ours:  # the job's push
        for round_ in range(args.repeats + 1):  # round 0 warms every path up
            perturbed(named, round_)
            copy_s = copy_seconds(named, buffer)
            started = time.perf_counter()
            push_stats = ours.push(named, round_, None, None)
            push_s = time.perf_counter() - started
            file_s = file_seconds(named, receiver, Path("/dev/shm") / f"bench_weights_{os.getpid()}.safetensors")
            if round_:
                copies.append(copy_s)
                pushes.append(push_s)
                files.append(file_s)
                stats.append(push_stats)
    # The push really landed: the engine answers the probe from the last version with the trainer's logprobs.
    with torch.no_grad():
        logits = model(torch.tensor([PROBE])).logits[0]
    expected = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(PROBE[1:])[:, None]).squeeze(-1)
    probe = Probe.text(PROBE)
    answer, fixed_ms = asyncio.run(probe_and_round_trips(engine.url, probe))
    gap = probe.gap(answer, str(args.repeats), expected.tolist(), 2e-3, engine.url)
    procs.stop(engine.proc)
    copy_s, push_s, file_s = statistics.median(copies), statistics.median(pushes), statistics.median(files)
    phases = {key.split("/")[1]: statistics.median(s[key] for s in stats) for key in stats[0]
              if key.endswith("_s") and key != "weight_sync/push_s"}
    result = {"parameters_m": sum(t.numel() for _, t in named) / 1e6, "megabytes": nbytes / 1e6,
              "buckets": stats[0]["weight_sync/buckets"], "copy_s": copy_s, "push_s": push_s, "file_s": file_s,
              "push_gb_s": nbytes / push_s / 1e9, "copy_gb_s": nbytes / copy_s / 1e9, "file_gb_s": nbytes / file_s / 1e9,
              "push_vs_copy": push_s / copy_s, "file_vs_push": file_s / push_s, "probe_gap": gap,
              "round_trip_ms": fixed_ms, **phases}
    print(f"{name}: {result['parameters_m']:.1f}M parameters, {result['megabytes']:.1f} MB float32, "
          f"{result['buckets']:.0f} bucket(s) of <= {args.bucket_mb} MB")
    print(f"  copy  {copy_s * 1e3:8.2f} ms  {result['copy_gb_s']:6.2f} GB/s   (one host copy of the parameters)")
    print(f"  push  {push_s * 1e3:8.2f} ms  {result['push_gb_s']:6.2f} GB/s   = {result['push_vs_copy']:.2f}x the copy "
          f"(probe gap after the push {gap:.1e})")
    print(f"  file  {file_s * 1e3:8.2f} ms  {result['file_gb_s']:6.2f} GB/s   (old /dev/shm safetensors path: "
          f"{result['file_vs_push']:.2f}x the push)")
    print("  push phases: " + "  ".join(f"{k} {v * 1e3:.2f} ms" for k, v in phases.items())
          + f"   one HTTP round trip {fixed_ms:.2f} ms (a push makes three)")
    return result


async def probe_and_round_trips(url: str, probe: Probe, repeats: int = 20) -> tuple[dict, float]:
    """The engine's answer to the probe, and the median round trip of an empty control call: the floor of each
    of the push's HTTP calls."""
    times = []
    async with EngineClient(url, timeout_s=600) as client:
        answer = await client.post("/generate", probe.request())
        for _ in range(repeats):
            started = time.perf_counter()
            await client.model_info()
            times.append(time.perf_counter() - started)
    return answer, statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,gpt2-86m")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads here and in the engine")
    parser.add_argument("--bucket-mb", type=int, default=512, help="rollout.weight_bucket_mb")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores, {args.threads} torch thread(s)")
    summary = {}
    with tempfile.TemporaryDirectory(prefix="bench_weights_") as tmp, ManagedProcesses() as procs:
        for name in args.models.split(","):
            result = bench_one(name, bench_model(name, Path(tmp), context=128), args, Path(tmp), procs)
            key = "86m" if name == "gpt2-86m" else name
            summary.update({f"weight_push_vs_copy_{key}": round(result["push_vs_copy"], 3),
                            f"push_s_{key}": round(result["push_s"], 5), f"copy_s_{key}": round(result["copy_s"], 5),
                            f"file_s_{key}": round(result["file_s"], 5),
                            f"push_gb_s_{key}": round(result["push_gb_s"], 3),
                            f"file_gb_s_{key}": round(result["file_gb_s"], 3)})
    summary["weight_push_vs_copy"] = max(v for k, v in summary.items() if k.startswith("weight_push_vs_copy_"))
    summary["load_average"] = round(os.getloadavg()[0], 2)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
