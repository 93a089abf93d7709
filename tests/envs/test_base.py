"""The Env interface: blocking envs in threads, loading env classes by import path, stuck threads."""

import asyncio
import threading
import time

import pytest

from envs.base import Action, Env, StepResult, SyncEnv, SyncEnvAdapter
from envs.factory import load_env_class, make_env_factory
from envs.threads import make_executor
from envs.calculator import CalculatorEnv
from envs.pool import EnvPool
from envs.sentiment import SentimentEnv


def act(text: str) -> Action:
    return Action(text=text, token_ids=[])



class BlockingEnv(SyncEnv):
    """A blocking env: time.sleep stands in for a subprocess or a synchronous HTTP call."""

    def __init__(self, seconds: float = 0.3):
        self.seconds = seconds

    def reset(self, sample):
        return "blocking"

    def step(self, action):
        time.sleep(self.seconds)
        return StepResult(None, float(threading.get_ident() != threading.main_thread().ident), True)


@pytest.mark.timeout(30)
def test_blocking_env_runs_in_threads_without_stalling_the_loop():
    executor = make_executor(4)
    factory = make_env_factory(BlockingEnv, {"seconds": 0.3}, executor)
    pool = EnvPool(factory, num_envs=4, step_timeout_s=5)
    ticks = []

    async def ticker(stop: asyncio.Event):
        while not stop.is_set():
            ticks.append(time.perf_counter())
            await asyncio.sleep(0.01)

    async def one():
        async with pool.lease() as env:
            await env.reset({})
            return await env.step(act("x"))

    async def main():
        stop = asyncio.Event()
        tick_task = asyncio.create_task(ticker(stop))
        start = time.perf_counter()
        results = await asyncio.gather(*(one() for _ in range(4)))
        elapsed = time.perf_counter() - start
        stop.set()
        await tick_task
        return results, elapsed

    try:
        results, elapsed = asyncio.run(main())
    finally:
        executor.shutdown(wait=True)
    assert all(r.reward == 1.0 for r in results)  # stepped on a worker thread
    assert elapsed < 0.3 * 4 * 0.75  # the four blocking steps overlapped
    gaps = [b - a for a, b in zip(ticks, ticks[1:])]
    assert len(ticks) >= 10 and max(gaps) < 0.15  # the loop kept ticking during the blocking calls
    assert isinstance(factory(), SyncEnvAdapter)


def test_sync_env_factory_needs_an_executor():
    with pytest.raises(ValueError, match="executor"):
        make_env_factory(BlockingEnv)


def test_load_env_class_good_paths():
    assert load_env_class("envs.calculator:CalculatorEnv") is CalculatorEnv
    assert load_env_class("envs.sentiment.SentimentEnv") is SentimentEnv
    example = load_env_class("envs.examples.echo_length:TargetLengthEnv")
    assert issubclass(example, Env)
    assert isinstance(make_env_factory("envs.calculator:CalculatorEnv", {"max_turns": 2})(), CalculatorEnv)


@pytest.mark.parametrize("path, error, message", [
    ("envs.no_such_module:Env", ImportError, "cannot import module 'envs.no_such_module'"),
    ("envs.calculator:NoSuchEnv", ImportError, "has no attribute 'NoSuchEnv'"),
    ("envs.calculator:safe_eval", TypeError, "not an environment class"),
    ("json:JSONDecoder", TypeError, "subclass envs.base.Env"),
    ("CalculatorEnv", ValueError, "pkg.module:name"),
    ("", ValueError, "non-empty"),
])
def test_load_env_class_bad_paths(path, error, message):
    with pytest.raises(error, match=message):
        load_env_class(path)


# ---------------------------------------------------------------- task envs



STUCK_ENV_SCRIPT = """
import asyncio, itertools, sys, threading, time
from envs.base import Action, StepResult, SyncEnv
from envs.factory import make_env_factory
from envs.threads import make_executor
from envs.pool import EnvFailure, EnvPool

calls = itertools.count()

class FirstTwoStepsNeverReturn(SyncEnv):
    def reset(self, sample):
        return "state"

    def step(self, action):
        if next(calls) < 2:
            threading.Event().wait()  # a hung subprocess or socket read: never returns
        return StepResult(None, 1.0, True)

pool = EnvPool(make_env_factory(FirstTwoStepsNeverReturn, {}, make_executor(2)), num_envs=8,
               step_timeout_s=0.5, max_failed_ratio=1.0)

async def trajectory(i):
    await asyncio.sleep(0.05 * i)  # the two stuck calls come first
    try:
        async with pool.lease() as env:
            await env.reset({})
            return (await env.step(Action(text="x", token_ids=[]))).reward
    except EnvFailure:
        return None

async def main():
    return await asyncio.wait_for(asyncio.gather(*(trajectory(i) for i in range(8))), 20)

results = asyncio.run(main())
print("ok", sum(r == 1.0 for r in results), "failed", results.count(None), flush=True)
"""


@pytest.mark.timeout(60)
def test_a_never_returning_sync_env_costs_its_thread_not_the_pool_nor_the_exit():
    """Two stuck calls on a pool of two threads: the other six still run, and the process still exits."""
    import subprocess
    import sys

    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", STUCK_ENV_SCRIPT], capture_output=True, text=True, timeout=40)
    seconds = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["ok", "6", "failed", "2"], proc.stdout + proc.stderr[-2000:]
    assert seconds < 20  # ThreadPoolExecutor would join the stuck threads at exit, forever


def test_env_thread_pool_runs_queued_calls_and_cancels_them_on_shutdown():
    from envs.threads import EnvThreadPool

    pool = EnvThreadPool(1)
    gate = threading.Event()
    first = pool.submit(gate.wait)
    queued = pool.submit(lambda: "never")
    deadline = time.monotonic() + 5
    while not first.running() and time.monotonic() < deadline:
        time.sleep(0.01)
    pool.shutdown()
    assert queued.cancelled()
    gate.set()
    assert first.result(timeout=5) is True
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(lambda: None)
