"""The env pool: admission by semaphore, the free list, failures, timeouts, the failure budget."""

import asyncio
import logging
import random
import time

import pytest

from envs.base import Action, Env, StepResult
from envs.pool import EnvFailure, EnvPool, TooManyEnvFailures


def act(text: str) -> Action:
    return Action(text=text, token_ids=[])



class SleepyEnv(Env):
    """Steps take `sample['delay']` seconds; records how many instances are busy at once."""

    def __init__(self, tracker: dict):
        self.tracker = tracker
        self.closed = False

    async def reset(self, sample):
        self.tracker["busy"] += 1
        self.tracker["max_busy"] = max(self.tracker["max_busy"], self.tracker["busy"])
        self.delay = sample["delay"]
        return "state"

    async def step(self, action):
        await asyncio.sleep(self.delay)
        self.tracker["busy"] -= 1
        return StepResult(None, 1.0, True)

    async def close(self):
        self.closed = True


class BrokenEnv(Env):
    async def reset(self, sample):
        return "state"

    async def step(self, action):
        raise RuntimeError("sandbox crashed: exit code 139")


class HungEnv(Env):
    def __init__(self):
        self.closed = False

    async def reset(self, sample):
        return "state"

    async def step(self, action):
        await asyncio.sleep(3600)

    async def close(self):
        self.closed = True


async def episode(pool: EnvPool, sample: dict, log: list | None = None):
    """One trajectory's use of the pool: lease, reset, step, give back."""
    async with pool.lease() as env:
        await env.reset(sample)
        await env.step(act("x"))
        if log is not None:
            log.append((sample["name"], id(env.env)))
        return env.env


@pytest.mark.timeout(30)
def test_pool_bounds_envs_and_reuses_them_under_load():
    tracker = {"busy": 0, "max_busy": 0}
    pool = EnvPool(lambda: SleepyEnv(tracker), num_envs=5, step_timeout_s=5)
    rng = random.Random(0)
    samples = [{"delay": rng.uniform(0.0, 0.03)} for _ in range(50)]

    async def main():
        return await asyncio.gather(*(episode(pool, s) for s in samples))

    envs = asyncio.run(main())
    assert tracker["max_busy"] <= 5 and pool.max_in_use <= 5
    assert pool.max_in_use == 5  # the limit was actually reached
    assert pool.created == 5 and len({id(e) for e in envs}) == 5  # built lazily, then reused
    assert pool.in_use == 0 and pool.failed == 0 and pool.finished == 50


@pytest.mark.timeout(30)
def test_fast_trajectory_frees_its_env_for_the_next_before_slow_one_ends():
    tracker = {"busy": 0, "max_busy": 0}
    pool = EnvPool(lambda: SleepyEnv(tracker), num_envs=2, step_timeout_s=5)
    finished: list = []

    async def main():
        slow = asyncio.create_task(episode(pool, {"delay": 0.5, "name": "slow"}, finished))
        await asyncio.sleep(0)
        fast = asyncio.create_task(episode(pool, {"delay": 0.02, "name": "fast"}, finished))
        await asyncio.sleep(0)
        queued = asyncio.create_task(episode(pool, {"delay": 0.02, "name": "queued"}, finished))
        await asyncio.gather(slow, fast, queued)

    asyncio.run(main())
    names = [name for name, _ in finished]
    env_of = dict(finished)
    # i % n would have put "queued" (index 2) behind "slow" (index 0); the free list gives it fast's env.
    assert names == ["fast", "queued", "slow"]
    assert env_of["queued"] == env_of["fast"] != env_of["slow"]
    assert pool.created == 2


@pytest.mark.timeout(30)
def test_raising_env_fails_trajectory_counts_and_logs_traceback(caplog):
    pool = EnvPool(BrokenEnv, num_envs=2, step_timeout_s=5, max_failed_ratio=0.5)

    async def main():
        with pytest.raises(EnvFailure, match="sandbox crashed"):
            await episode(pool, {})

    with caplog.at_level(logging.ERROR, logger="envs.pool"):
        asyncio.run(main())
    assert pool.failed == 1 and pool.finished == 1 and pool.in_use == 0
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "Traceback" in logged and "sandbox crashed: exit code 139" in logged and "BrokenEnv.step" in logged


@pytest.mark.timeout(30)
def test_hung_env_times_out_and_is_replaced():
    pool = EnvPool(HungEnv, num_envs=1, step_timeout_s=0.2)

    async def main():
        start = time.perf_counter()
        with pytest.raises(EnvFailure, match="timed out after 0.2 s"):
            await episode(pool, {})
        elapsed = time.perf_counter() - start
        async with pool.lease() as lease:
            return elapsed, lease.env

    elapsed, second_env = asyncio.run(main())
    assert elapsed < 2.0
    assert pool.failed == 1 and pool.created == 2  # the hung env was dropped, a fresh one built
    assert not second_env.closed


@pytest.mark.timeout(30)
def test_hung_env_is_closed_and_not_reused():
    envs: list = []

    def factory():
        envs.append(HungEnv())
        return envs[-1]

    pool = EnvPool(factory, num_envs=1, step_timeout_s=0.1)

    async def main():
        with pytest.raises(EnvFailure):
            await episode(pool, {})
        async with pool.lease() as lease:
            return lease.env

    second = asyncio.run(main())
    assert envs[0].closed and second is envs[1]


@pytest.mark.timeout(30)
def test_too_many_failures_raise_with_a_clear_message():
    good = {"busy": 0, "max_busy": 0}
    builds = iter([SleepyEnv(good), BrokenEnv()])
    pool = EnvPool(lambda: next(builds), num_envs=2, step_timeout_s=5, max_failed_ratio=0.25)

    async def main():
        before = pool.counts()
        results = await asyncio.gather(*(episode(pool, {"delay": 0.01 * i}) for i in range(4)),
                                       return_exceptions=True)
        return before, results

    before, results = asyncio.run(main())
    failures = sum(isinstance(r, EnvFailure) for r in results)
    assert failures == pool.failed >= 1
    with pytest.raises(TooManyEnvFailures, match=r"failed in their environment .*max_failed_ratio=25%"):
        pool.check_failure_ratio(since=before)
    pool.check_failure_ratio(since=pool.counts())  # nothing new since the snapshot: no error
    lenient = EnvPool(BrokenEnv, num_envs=1, max_failed_ratio=1.0)
    lenient.failed = lenient.finished = 3
    lenient.check_failure_ratio()


def test_pool_rejects_bad_settings():
    with pytest.raises(ValueError, match="num_envs"):
        EnvPool(BrokenEnv, num_envs=0)
    with pytest.raises(ValueError, match="max_failed_ratio"):
        EnvPool(BrokenEnv, num_envs=1, max_failed_ratio=1.5)


@pytest.mark.timeout(30)
def test_factory_error_counts_as_env_failure():
    def factory():
        raise OSError("no sandbox quota left")

    pool = EnvPool(factory, num_envs=1)

    async def main():
        with pytest.raises(EnvFailure, match="no sandbox quota left"):
            await episode(pool, {})

    asyncio.run(main())
    assert pool.failed == 1 and pool.in_use == 0
