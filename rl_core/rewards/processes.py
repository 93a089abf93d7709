"""Worker processes for blocking reward functions.

Why processes: checkers such as math-verify bound a parse with `signal` timeouts, which only a
main thread receives, and a runaway sympy call in a thread would hold rank 0's interpreter.
In a worker process every call runs on the main thread. Why not concurrent.futures' own
process pool: its shutdown waits for a worker stuck in a call, so a hung checker would hang
the job's exit; `multiprocessing.Pool.terminate` kills it instead.

Each worker leads its own process group. torchrun stops a rank by signalling the rank's process
group: an idle worker killed there dies holding the task queue's lock (an idle worker waits for
a task holding it), and `Pool.terminate` then waits for that lock forever, so rank 0 never
finished its clean-up after a SIGTERM (issue 35). Out of that group only rank 0 stops them.
"""

from __future__ import annotations

import concurrent.futures
import gc
import multiprocessing
import os
import signal

from workers.procs import set_parent_death_signal


def _init_worker() -> None:
    os.setpgid(0, 0)  # out of the rank's process group: see the module's docstring
    set_parent_death_signal(signal.SIGKILL)  # no worker outlives rank 0, however it dies
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle; it terminates the pool


class ProcessExecutor(concurrent.futures.Executor):
    """`submit(fn, *args)` runs in one of `processes` spawned workers; `fn` and its arguments must
    pickle (a function loaded by import path does). Create it on the main thread."""

    def __init__(self, processes: int):
        if processes < 1:
            raise ValueError(f"processes must be >= 1, got {processes}; set reward.fn_processes")
        # spawn: rank 0 runs threads (asyncio, engines' clients), which a forked child must not inherit.
        self._pool = multiprocessing.get_context("spawn").Pool(processes, initializer=_init_worker)

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_running_or_notify_cancel()  # running: a caller that gives up cannot cancel it under us

        def settle(setter, value) -> None:
            if not future.done():
                setter(value)

        self._pool.apply_async(fn, args, kwargs, callback=lambda value: settle(future.set_result, value),
                               error_callback=lambda err: settle(future.set_exception, err))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        if self._pool is None:
            return
        self._pool.terminate()  # a worker stuck in a call is killed, never waited for
        if wait:
            self._pool.join()
        # Freed now, its queues' semaphores are unregistered now: a rank stopped by a signal ends with
        # os._exit, and the resource tracker would otherwise report them as leaked.
        self._pool = None
        gc.collect()
