"""Running a job through torchrun from a test, and reading what it logged."""

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest


def torchrun(module: str, config: str, *args: str, ranks: int = 2) -> list[str]:
    """The command line of a standalone torchrun of the job `module` (rl_core.train, rl_core.train_sft, ...) on
    `ranks` processes, with its recipe and `key=value` overrides."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--standalone",
            "-m", module, "--config", config, *args]


def read_metrics(run_dir) -> list[dict]:
    """The rows of a run's metrics.jsonl, in order."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def undocumented_metrics(rows: list[dict]) -> list[str]:
    """The names in a job's metrics rows (PPO, SFT, DPO, reward model) that have no entry in rl_core/metric_docs/,
    so docs/metrics.md does not explain them: add one there and run scripts/metrics_reference.py."""
    from rl_core.metric_docs import undocumented

    return undocumented(name for row in rows for name in row)


def output_lines(proc: subprocess.Popen, deadline: float | None = None) -> Iterator[str]:
    """The lines of `proc`'s output (its binary stdout pipe) as they arrive, until it has exited and the pipe
    holds nothing more: not until the pipe's end, which a process the job left behind would hold off
    (`run_to_end` names any). Raises subprocess.TimeoutExpired at `deadline` (monotonic) if the process is
    still running."""
    fd, pending = proc.stdout.fileno(), b""
    while True:
        exited = proc.poll() is not None
        if not exited and deadline is not None and time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(proc.args, 0)
        # Once it has exited, what its processes wrote is in the pipe already.
        readable, _, _ = select.select([fd], [], [], 0.2 if exited else 0.5)
        data = os.read(fd, 1 << 16) if readable else b""
        if data:
            # universal newlines, as a text-mode pipe reads them (progress bars end lines with \r)
            *lines, pending = (pending + data).replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
            yield from (line.decode(errors="replace") for line in lines)
        elif readable or exited:  # the pipe's end, or nothing more after the exit
            break
    if pending:
        yield pending.decode(errors="replace")


def pipe_holders(fd: int) -> list[str]:
    """The other processes that hold the pipe behind this process's `fd` open: "pid command" each."""
    target, holders = f"pipe:[{os.fstat(fd).st_ino}]", []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if any(os.readlink(link) == target for link in (entry / "fd").iterdir()):
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                holders.append(f"{entry.name} {command}")
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return holders


def run_to_end(argv: list[str], timeout: float, cwd=None, env: dict[str, str] | None = None) -> str:
    """Run `argv` in its own session (a timeout kills torchrun *and* its ranks: no orphans left for
    later tests), with `env` added to this process's environment; return its output, failing the test with
    the output's tail unless it exits 0, or if any process still holds its output once it has exited (one
    would keep a `| tee` of the job, or any reader of its output to the end, waiting)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd,
                            env=None if env is None else {**os.environ, **env})
    lines = []
    try:
        lines.extend(output_lines(proc, deadline=time.monotonic() + timeout))
        proc.wait(timeout=timeout)  # the pipe may end before the process does
        holders = pipe_holders(proc.stdout.fileno())
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"the job did not finish within {timeout}s:\n" + "\n".join(lines)[-5000:])
    finally:
        proc.stdout.close()
    output = "\n".join(lines) + "\n"
    assert proc.returncode == 0, output[-6000:]
    assert holders == [], f"still holding the job's output after it exited: {holders}"
    return output
