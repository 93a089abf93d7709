"""Where a profiled step's time went, from its torch profiler trace: the phases, the device's kernel time
in each, and the CPU-only ops over 0.5 ms (ops that launched no device work: on a GPU rank these are
bookkeeping and should take microseconds).

    python scripts/gpu/trace_summary.py TRACE.json[.gz] ...

Standard library only, so it runs on the GPU machine after the bench and here on what came back.
"""

from __future__ import annotations

import bisect
import collections
import gzip
import json
import sys

PHASES = ("rollout", "inference", "train", "sync")


def summary(path: str) -> str:
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    step = next(e for e in events if e["name"] == "train step")
    phases = [e for e in events if e.get("cat") == "user_annotation" and e["tid"] == step["tid"]
              and e["name"] in PHASES and step["ts"] <= e["ts"] <= step["ts"] + step["dur"]]

    def phase_of(ts: float) -> str:
        return next((p["name"] for p in phases if p["ts"] <= ts <= p["ts"] + p["dur"]), "other")

    kernels = collections.Counter()
    for e in events:
        if e.get("cat") == "kernel":
            kernels[phase_of(e["ts"])] += e["dur"]
    launches = collections.defaultdict(list)  # per thread: when it called the CUDA runtime or driver
    for e in events:
        if e["pid"] == step["pid"] and e.get("cat") in ("cuda_runtime", "cuda_driver"):
            launches[e["tid"]].append(e["ts"])
    for stamps in launches.values():
        stamps.sort()
    host_ops, host_by_phase = collections.Counter(), collections.Counter()
    counted_until: dict[int, float] = {}  # per thread: the end of the last op counted (its inner ops are in it)
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        if e["pid"] != step["pid"] or e.get("cat") != "cpu_op" or e["dur"] < 500:
            continue
        if e["ts"] < counted_until.get(e["tid"], 0):
            continue  # inside an op already counted
        stamps = launches[e["tid"]]
        i = bisect.bisect_left(stamps, e["ts"])
        if i < len(stamps) and stamps[i] <= e["ts"] + e["dur"]:
            continue  # it launched device work
        counted_until[e["tid"]] = e["ts"] + e["dur"]
        host_ops[e["name"]] += e["dur"]
        host_by_phase[phase_of(e["ts"])] += e["dur"]
    ms = lambda us: f"{us / 1000:.0f}"  # noqa: E731
    lines = [f"{path}: step {ms(step['dur'])} ms",
             "  phase ms:  " + ", ".join(f"{p['name']} {ms(p['dur'])}" for p in phases),
             "  kernels ms: " + ", ".join(f"{k} {ms(v)}" for k, v in kernels.most_common()),
             f"  CPU-only ops over 0.5 ms: {ms(sum(host_ops.values()))} ms ("
             + ", ".join(f"{k} {ms(v)}" for k, v in host_by_phase.most_common()) + "); "
             + ", ".join(f"{k} {ms(v)}" for k, v in host_ops.most_common(6))]
    return "\n".join(lines)


if __name__ == "__main__":
    for trace in sys.argv[1:]:
        print(summary(trace))
