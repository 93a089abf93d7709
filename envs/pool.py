"""A pool of at most `num_envs` environments shared by many concurrent trajectories.

Environments are scarce (sandboxes, API quotas), trajectories are many and of uneven length.
Assigning trajectory i to env i % n would leave envs idle while others queue, so instead an
`asyncio.Semaphore(num_envs)` admits trajectories and each one takes a free env when it starts
and gives it back when it ends (a free list). Envs are built lazily, up to `num_envs`, and reused.

Every env call goes through the lease, which enforces `step_timeout_s` and turns an exception
into `EnvFailure`: the trajectory ends as failed, is counted and logged with its traceback, and
is left out of training. An env that timed out may still be busy, so it is closed and dropped
(a fresh one is built when needed); an env that raised is reused, since `reset` starts over.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
import traceback
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable, Union

from envs.base import Action, Env, Observation, StepResult
from rl_core.errors import UserError

logger = logging.getLogger(__name__)

EnvFactory = Callable[[], Union[Env, Awaitable[Env]]]


class EnvFailure(Exception):
    """An env raised or timed out; the trajectory using it is failed and left out of training."""


class TooManyEnvFailures(UserError, RuntimeError):
    """More trajectories failed in their env than `max_failed_ratio` allows."""


@dataclass(frozen=True)
class PoolCounts:
    """Snapshot of the pool's counters, to measure one rollout with `check_failure_ratio(since=...)`."""

    finished: int = 0
    failed: int = 0


class EnvLease:
    """One env lent to one trajectory; each call is timed out, timed and guarded."""

    def __init__(self, env: Env, step_timeout_s: float | None):
        self.env = env
        self.step_timeout_s = step_timeout_s
        self.env_time_s = 0.0
        self.error: str | None = None
        self.hung = False

    @property
    def failed(self) -> bool:
        return self.error is not None

    async def reset(self, sample: dict) -> Observation | None:
        return await self._call("reset", self.env.reset(sample))

    async def step(self, action: Action) -> StepResult:
        result = await self._call("step", self.env.step(action))
        if not isinstance(result, StepResult):
            self._fail("step", f"returned {type(result).__name__}, expected envs.base.StepResult")
        return result

    def next_sampling(self) -> dict:
        return self.env.next_sampling()

    async def _call(self, what: str, call: Awaitable):
        start = time.perf_counter()
        try:
            return await asyncio.wait_for(call, timeout=self.step_timeout_s)
        except asyncio.TimeoutError:
            self.hung = True
            self._fail(what, f"timed out after {self.step_timeout_s} s (env.step_timeout_s)")
        except Exception as err:  # any env bug ends this trajectory only
            self._fail(what, "".join(traceback.format_exception(err)).rstrip())
        finally:
            self.env_time_s += time.perf_counter() - start

    def reject(self, what: str, detail: str) -> None:
        """Fail the trajectory for an env output the framework cannot use (e.g. a malformed observation)."""
        self._fail(what, detail)

    def _fail(self, what: str, detail: str) -> None:
        self.error = f"{type(self.env).__name__}.{what} {detail}"
        raise EnvFailure(self.error)


class EnvPool:
    """At most `num_envs` envs in use at once, handed out from a free list and reused."""

    def __init__(self, factory: EnvFactory, num_envs: int, step_timeout_s: float | None = 60.0,
                 max_failed_ratio: float = 0.1):
        if num_envs < 1:
            raise ValueError(f"env.num_envs must be >= 1, got {num_envs}")
        if step_timeout_s is not None and step_timeout_s <= 0:
            raise ValueError(f"env.step_timeout_s must be > 0 (or null for no limit), got {step_timeout_s}")
        if not 0.0 <= max_failed_ratio <= 1.0:
            raise ValueError(f"env.max_failed_ratio must be in [0, 1], got {max_failed_ratio}")
        self.factory = factory
        self.num_envs = num_envs
        self.step_timeout_s = step_timeout_s
        self.max_failed_ratio = max_failed_ratio
        self._slots: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._free: list[Env] = []
        self.created = 0
        self.in_use = 0
        self.max_in_use = 0
        self.finished = 0
        self.failed = 0

    @contextlib.asynccontextmanager
    async def lease(self) -> AsyncIterator[EnvLease]:
        """Lend a free env for one whole trajectory; `EnvFailure` inside is recorded, then re-raised."""
        async with self._semaphore():
            lease = EnvLease(await self._take(), self.step_timeout_s)
            self.in_use += 1
            self.max_in_use = max(self.max_in_use, self.in_use)
            try:
                yield lease
            finally:
                self.in_use -= 1
                await self._finish(lease)
                await self._give_back(lease)

    def has_free_env(self) -> bool:
        """Whether a lease taken now starts without waiting for another trajectory to finish."""
        return not self._semaphore().locked()

    def _semaphore(self) -> asyncio.Semaphore:
        """The admission semaphore of the running loop (each `asyncio.run` gets a fresh, idle one)."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self.in_use:
                raise RuntimeError("EnvPool is in use from two event loops at once; drive it from one loop")
            self._slots, self._loop = asyncio.Semaphore(self.num_envs), loop
        return self._slots

    async def _take(self) -> Env:
        if self._free:
            return self._free.pop()
        try:
            env = self.factory()
            if inspect.isawaitable(env):
                env = await env
            if not isinstance(env, Env):
                raise TypeError(f"env factory returned {type(env).__name__}; it must return an envs.base.Env")
        except Exception as err:
            self.finished += 1
            self.failed += 1
            detail = "".join(traceback.format_exception(err)).rstrip()
            logger.error("building an env failed, trajectory left out of training: %s", detail)
            raise EnvFailure(f"env factory failed: {detail}") from err
        self.created += 1
        return env

    async def _finish(self, lease: EnvLease) -> None:
        """Tell the env its trajectory ended (a hung one is closed instead); a failure here is logged, not raised."""
        if lease.hung:
            return
        try:
            await asyncio.wait_for(lease.env.finish(), timeout=self.step_timeout_s)
        except Exception as err:  # noqa: BLE001 - the trajectory is over either way
            logger.warning("%s.finish failed: %r", type(lease.env).__name__, err)

    async def _give_back(self, lease: EnvLease) -> None:
        self.finished += 1
        if not lease.failed:
            self._free.append(lease.env)
            return
        self.failed += 1
        logger.error("env failure, trajectory left out of training: %s", lease.error)
        if lease.hung:
            await self._discard(lease.env)
        else:
            self._free.append(lease.env)

    async def _discard(self, env: Env) -> None:
        """Close a hung env without waiting on it forever; a new one is built lazily."""
        try:
            await asyncio.wait_for(env.close(), timeout=self.step_timeout_s)
        except Exception as err:
            logger.warning("closing a hung %s failed: %r", type(env).__name__, err)

    def counts(self) -> PoolCounts:
        return PoolCounts(finished=self.finished, failed=self.failed)

    def check_failure_ratio(self, since: PoolCounts | None = None) -> None:
        """Raise `TooManyEnvFailures` if failed/finished (since a snapshot) exceeds `max_failed_ratio`."""
        since = since or PoolCounts()
        finished, failed = self.finished - since.finished, self.failed - since.failed
        if finished and failed / finished > self.max_failed_ratio:
            raise TooManyEnvFailures(
                f"{failed} of {finished} trajectories failed in their environment "
                f"({failed / finished:.0%} > env.max_failed_ratio={self.max_failed_ratio:.0%}); "
                "the tracebacks are in the log above. Fix the env, raise env.step_timeout_s if it is "
                "slow, or raise env.max_failed_ratio to tolerate more failures."
            )

    async def close(self) -> None:
        """Close every idle env (call after the last rollout)."""
        envs, self._free = self._free, []
        for env in envs:
            try:
                await asyncio.wait_for(env.close(), timeout=self.step_timeout_s)
            except Exception as err:
                logger.warning("closing %s failed: %r", type(env).__name__, err)
