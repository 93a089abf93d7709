"""Threads for blocking calls (env calls, tools, rule-based rewards) that can never hang the job.

Its own module so that everything that runs blocking work (`envs.base`, `envs.tools`, the reward workers)
imports it without importing each other.
"""

from __future__ import annotations

import asyncio
import functools
import queue
import threading
from concurrent.futures import Executor, Future
from typing import Any, Callable


class EnvThreadPool(Executor):
    """At most `max_workers` threads running blocking env calls, none of which can hang the job.

    Unlike `ThreadPoolExecutor`, whose threads are joined at interpreter exit (so one env call
    that never returns keeps a failed job alive forever), the threads are daemons, and
    `abandon(future)` (called when a caller gives up on a call, e.g. on `env.step_timeout_s`)
    frees that call's slot for a fresh thread: a stuck env loses its thread, not the pool.
    """

    def __init__(self, max_workers: int, name: str = "env-worker"):
        if max_workers < 1:
            raise ValueError(f"env executor needs max_workers >= 1, got {max_workers}")
        self.max_workers = max_workers
        self.name = name
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._workers = 0  # live threads counted against max_workers (abandoned ones are not)
        self._idle = 0  # threads waiting for work
        self._pending = 0  # calls queued and not yet taken
        self._running: dict[Future, threading.Thread] = {}
        self._abandoned: set[threading.Thread] = set()
        self._shutdown = False
        self._started = 0

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot submit to an EnvThreadPool after shutdown")
            self._pending += 1
            self._work.put((future, fn, args, kwargs))
            self._grow()
        return future

    def _grow(self) -> None:
        """Start a thread if calls wait that no idle thread will take (caller holds the lock)."""
        if self._pending > self._idle and self._workers < self.max_workers:
            self._workers += 1
            self._started += 1
            threading.Thread(target=self._serve, name=f"{self.name}-{self._started}", daemon=True).start()

    def _serve(self) -> None:
        me = threading.current_thread()
        while True:
            with self._lock:
                self._idle += 1
            item = self._work.get()
            with self._lock:
                self._idle -= 1
                if item is None:  # shutdown: wake the next thread too
                    self._work.put(None)
                    self._workers -= 1
                    return
                self._pending -= 1
            future, fn, args, kwargs = item
            if not future.set_running_or_notify_cancel():
                continue
            with self._lock:
                self._running[future] = me
            try:
                result = fn(*args, **kwargs)
            except BaseException as err:  # noqa: BLE001 - handed to the caller through the future
                future.set_exception(err)
            else:
                future.set_result(result)
            with self._lock:
                self._running.pop(future, None)
                if me in self._abandoned:  # its slot went to a new thread while it was stuck
                    self._abandoned.discard(me)
                    return

    def abandon(self, future: Future) -> None:
        """The caller gave up on `future`: cancel it if queued, else let its thread go and free its slot."""
        if future.cancel():
            return
        with self._lock:
            thread = self._running.get(future)
            if thread is not None and thread not in self._abandoned:
                self._abandoned.add(thread)
                self._workers -= 1
                self._grow()

    def shutdown(self, wait: bool = False, *, cancel_futures: bool = True) -> None:
        """Stop taking work; queued calls are cancelled. Never waits on a call that may never return."""
        with self._lock:
            self._shutdown = True
        if cancel_futures:
            while True:
                try:
                    item = self._work.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].cancel()
        self._work.put(None)


def make_executor(max_workers: int = 8) -> EnvThreadPool:
    """Thread pool for blocking env calls; size it to the env's real concurrency (e.g. num_envs)."""
    return EnvThreadPool(max_workers)


async def run_blocking(executor: Executor | None, fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """Run a blocking function (env call, rule-based reward) in `executor` and await its result.

    A caller that stops waiting (a timeout cancels this coroutine) abandons the call, so an
    `EnvThreadPool` gives its slot to a fresh thread.
    """
    if executor is None:
        return await asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args, **kwargs))
    future = executor.submit(fn, *args, **kwargs)
    try:
        return await asyncio.wrap_future(future)
    except asyncio.CancelledError:
        abandon = getattr(executor, "abandon", None)
        if abandon is not None:
            abandon(future)
        else:
            future.cancel()
        raise
