"""Rank 0's rollout in a process of its own (async mode), so that the rollout's Python (HTTP calls,
envs, parsing, reward functions) and the trainer's kernel launches no longer take turns on one GIL.

`RolloutProcess` has the methods of `RolloutService` and forwards each call, in order, to the
service built in a spawned child (a pipe: one request out, one answer back, matched by number, so
the answer to a call that a stop signal interrupted is recognised and dropped). The engines' weight
version is shared memory (`ServedVersion`): the producer reads it for every answer without a call.

The child leads its own process group (torchrun's SIGTERM to the rank's group reaches only rank 0,
which closes the child in its clean-up) and gets SIGKILL if rank 0 dies without one; its own
children (reward workers, MCP servers, sandboxes) follow it the same way.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
from typing import Any, Callable

from workers.gc_freeze import setup_objects_frozen
from workers.procs import exit_now, set_parent_death_signal

_SPAWN = multiprocessing.get_context("spawn")  # rank 0 runs threads, which a forked child must not inherit
_START, _CLOSE = "start", "close"


class ServedVersion:
    """The policy version the engines serve: rank 0 sets it after each push, the rollout reads it (a
    thread or the rollout process: shared memory, handed over when the process starts)."""

    def __init__(self) -> None:
        self._value = _SPAWN.RawValue("q", 0)  # one writer, 8 aligned bytes: no lock needed

    def __call__(self) -> int:
        return self._value.value

    def set(self, version: int) -> None:
        self._value.value = version


class RolloutProcess:
    """A `RolloutService` built by `build(*args, served_version)` in a child process; same calls, same answers.

    The child starts at once and imports `build`'s module (seconds: torch, the envs) while the job starts its
    engines; `start(*args)` then builds the service there. `build`, its arguments and every call's arguments
    and answers cross a pipe, so they must pickle (a module-level function and plain data do). An error
    raised in the child is raised here with its type and message."""

    def __init__(self, build: Callable[..., Any], served_version: ServedVersion):
        self._conn, child_end = _SPAWN.Pipe()
        self._process = _SPAWN.Process(target=_serve, args=(child_end, build, served_version), name="rollout")
        self._process.start()
        child_end.close()
        self._numbers = itertools.count()
        self._closed = False

    def start(self, *args) -> None:
        """Build the service in the child (envs, reward workers, the router's client) and wait until it is."""
        try:
            self._ask(_START, *args)
        except BaseException:
            self.close(timeout_s=5.0)
            raise

    # RolloutService's calls, each answered by the child's service
    def collect(self, samples, version):
        return self._ask("collect", samples, version)

    def collect_groups(self, groups, n_groups, keep_fn, max_groups, version):
        return self._ask("collect_groups", groups, n_groups, keep_fn, max_groups, version)

    def evaluate(self, samples, sampling_params, version):
        return self._ask("evaluate", samples, sampling_params, version)

    def hold(self) -> None:
        self._ask("hold")

    def release(self) -> None:
        self._ask("release")

    def start_producer(self, sample_batches, max_queued, max_staleness, in_flight=1) -> None:
        self._ask("start_producer", sample_batches, max_queued, max_staleness, in_flight)

    def next_batch(self, batch_size, current_version, max_staleness):
        return self._ask("next_batch", batch_size, current_version, max_staleness)

    @property
    def resume_state(self) -> dict | None:
        return self._ask("resume_state")

    def _ask(self, name: str, *args) -> Any:
        number = next(self._numbers)
        self._conn.send((number, name, args))
        return self._answer(number)

    def _answer(self, number: int) -> Any:
        while True:
            while not self._conn.poll(1.0):
                if not self._process.is_alive():
                    raise self._exited()
            try:
                answered, ok, value = self._conn.recv()
            except EOFError:
                self._process.join(5)
                raise self._exited() from None
            if answered != number:  # the answer to a call a stop signal interrupted
                continue
            if not ok:
                raise value
            return value

    def _exited(self) -> RuntimeError:
        return RuntimeError(f"the rollout process (pid {self._process.pid}) exited with code "
                            f"{self._process.exitcode}; see the lines above for why")

    def close(self, timeout_s: float = 30.0) -> None:
        """The child closes its service (producer, envs, reward workers, client) and exits; one that has not
        within `timeout_s` is killed with its process group."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout_s
        try:
            number = next(self._numbers)
            self._conn.send((number, _CLOSE, ()))
            while self._conn.poll(max(deadline - time.monotonic(), 0)):
                if self._conn.recv()[0] == number:
                    break
        except Exception:
            pass  # it died, or a stop signal cut an answer short: nothing is left to close but the process
        finally:
            self._process.join(max(deadline - time.monotonic(), 1.0))
            if self._process.is_alive():
                try:
                    os.killpg(self._process.pid, signal.SIGKILL)
                except OSError:
                    self._process.kill()
                self._process.join(5)
            self._conn.close()


def _portable(err: BaseException) -> BaseException:
    """`err` if it pickles, else a RuntimeError with its type and message."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        return RuntimeError(f"{type(err).__name__}: {err}")


def _serve(conn, build: Callable[..., Any], served_version: ServedVersion) -> None:
    """The child: build the service when asked, then run the calls in order on one thread, while this thread
    waits for the next message, so a close is never queued behind a call that waits (a batch)."""
    os.setpgid(0, 0)  # out of rank 0's process group: only rank 0 stops it
    set_parent_death_signal(signal.SIGKILL)  # rank 0 died without closing it
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle
    sending = threading.Lock()  # the answer to close may go out while a call's answer does

    def answer(number: int, ok: bool, value) -> None:
        with sending:
            conn.send((number, ok, value))

    try:
        number, name, args = conn.recv()
    except (EOFError, OSError):
        exit_now(0)  # rank 0 is gone before it needed the rollout
    if name == _CLOSE:
        answer(number, True, None)
        exit_now(0)
    try:
        service = build(*args, served_version)
    except BaseException as err:
        answer(number, False, _portable(err))
        exit_now(0)
    answer(number, True, None)
    calls: queue.SimpleQueue = queue.SimpleQueue()

    def run_calls() -> None:
        while True:
            number, name, args = calls.get()
            try:
                value = getattr(service, name)
                answer(number, True, value(*args) if callable(value) else value)
            except BaseException as err:
                try:
                    answer(number, False, _portable(err))
                except OSError:
                    return  # rank 0 is gone

    number = None
    # Frozen until the close: the service's own clean-up (its reward pool's queues) needs the collector.
    with setup_objects_frozen():
        threading.Thread(target=run_calls, name="rollout-calls", daemon=True).start()
        try:
            while True:
                number, name, args = conn.recv()
                if name == _CLOSE:
                    break
                calls.put((number, name, args))
        except (EOFError, OSError):
            number = None  # rank 0 is gone: close and leave
    try:
        service.close()
    finally:
        if number is not None:
            answer(number, True, None)
        exit_now(0)  # no join of a thread stuck in an env call or a reward function
