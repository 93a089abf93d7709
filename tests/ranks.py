"""Running a function on N gloo ranks from a test: the one way multi-process tests start their ranks.

- No port: the ranks meet through a file store in the test's own directory, so there is no port to
  choose, to lose to another process between choice and bind, or to collide with a parallel test.
- A safe end: every rank meets the others at a barrier, destroys the process group and leaves with
  `os._exit`. Gloo's worker threads and the store then never run into the interpreter's finalisation,
  which aborted a rank now and then (`terminate called without an active exception`, SIGABRT).
- A dead rank explains itself: each rank's stdout and stderr (C++ aborts included) go to its own log,
  and a failure shows every rank's exit status and the tail of its log.
- No orphans: the ranks die with the test process (PR_SET_PDEATHSIG), and a timeout or a failed rank
  kills the rest.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import pytest

COLLECTIVE_TIMEOUT_S = 600  # generous: a busy machine must not turn slowness into a failure


def run_ranks(fn: Callable, world_size: int, workdir, args: tuple = (), timeout_s: float = 600,
              collective_timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
    """Run `fn(rank, *args)` on `world_size` spawned ranks in one gloo group (collectives bounded by
    `collective_timeout_s`); fail the test with each rank's log unless every rank returns. `fn` must be
    importable (a module-level function)."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    store = workdir / f"gloo_store_{os.getpid()}_{time.monotonic_ns()}"
    logs = [workdir / f"rank{rank}.log" for rank in range(world_size)]
    context = multiprocessing.get_context("spawn")
    ranks = [context.Process(target=_rank_main, name=f"rank{rank}",
                             args=(fn, rank, world_size, str(store), str(logs[rank]), args, collective_timeout_s))
             for rank in range(world_size)]
    for process in ranks:
        process.start()
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.exitcode is None for p in ranks):
            if any(p.exitcode not in (None, 0) for p in ranks):
                time.sleep(2)  # let the others report what they saw before they are killed
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        for process in ranks:
            if process.exitcode is None:
                process.kill()
            process.join(10)
    if any(p.exitcode != 0 for p in ranks):
        pytest.fail(_failure_report(ranks, logs, timeout_s), pytrace=False)


def _failure_report(ranks, logs, timeout_s: float) -> str:
    lines = []
    for process, log in zip(ranks, logs):
        code = process.exitcode
        status = (f"killed by {signal.Signals(-code).name}" if code and code < 0 else f"exit status {code}")
        if code == -signal.SIGKILL:
            status += f" (still running after {timeout_s} s, or stopped after another rank failed)"
        tail = log.read_text(errors="replace")[-4000:] if log.exists() else "(no log)"
        lines.append(f"--- {process.name}: {status}; its output:\n{tail}")
    return "a rank failed:\n" + "\n".join(lines)


def _rank_main(fn: Callable, rank: int, world_size: int, store: str, log: str, args: tuple,
               collective_timeout_s: float) -> None:
    log_fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for stream_fd in (1, 2):  # file descriptors, so a C++ abort message lands in the log too
        os.dup2(log_fd, stream_fd)
    from workers.procs import set_parent_death_signal

    set_parent_death_signal(signal.SIGKILL)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    code = 1
    try:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=collective_timeout_s))
        fn(rank, *args)
        dist.barrier()  # nobody tears down while a peer still has a message in flight to it
        dist.destroy_process_group()
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # skip finalisation: gloo's threads must not meet a half torn-down interpreter
