"""scripts/bench_host_threads.py: the gpu86m batch's host bookkeeping, timed three ways in one run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_the_host_bookkeeping_bench_times_the_same_work_three_ways():
    proc = subprocess.run([sys.executable, "scripts/bench_host_threads.py", "--repeats", "2", "--threads", "2"],
                          cwd=REPO, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert list(out["ms"]) == ["2 threads, idle", "2 threads, busy neighbour", "1 thread, busy neighbour"]
    assert all(ms > 0 for ms in out["ms"].values())
    assert out["stall_ratio"] == out["ms"]["2 threads, busy neighbour"] / out["ms"]["1 thread, busy neighbour"]
