"""Env interface, env pool (admission, free list, failures, timeouts), blocking envs, task envs."""

import asyncio
import logging
import random
import threading
import time

import pytest

from envs.base import (Action, Env, StepResult, SyncEnv, SyncEnvAdapter, load_env_class, make_env_factory,
                       make_executor)
from envs.calculator import CalculatorEnv, format_number, safe_eval
from envs.pool import EnvFailure, EnvPool, TooManyEnvFailures
from envs.sentiment import SentimentEnv


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
    ("CalculatorEnv", ValueError, "pkg.module:ClassName"),
    ("", ValueError, "non-empty"),
])
def test_load_env_class_bad_paths(path, error, message):
    with pytest.raises(error, match=message):
        load_env_class(path)


# ---------------------------------------------------------------- task envs


@pytest.mark.parametrize("expression", ["2+3", "12*7+3", "-4 + 10 // 3", "2**10 - 1", "7/2", "(1+2)*(3-5) % 5"])
def test_safe_eval_matches_python_arithmetic(expression):
    assert safe_eval(expression) == eval(expression, {"__builtins__": {}})  # reference only, on trusted input


@pytest.mark.parametrize("expression", ["__import__('os').system('true')", "x + 1", "abs(-3)", "2**1000",
                                        "1/0", "[1, 2]", "2 +", "'a' * 3"])
def test_safe_eval_refuses_anything_but_arithmetic(expression):
    with pytest.raises(ValueError):
        safe_eval(expression)


def test_format_number():
    assert format_number(safe_eval("6/3")) == "2"
    assert format_number(safe_eval("7/2")) == "3.5"


def run(coro):
    return asyncio.run(coro)


def test_calculator_append_then_fresh_state_then_correct_answer():
    env = CalculatorEnv(max_turns=5, summarize_every=2)
    state0 = run(env.reset({"expression": "12*7+3"}))
    assert "12*7+3" in state0

    a1 = "Let me see <calc>12*7</calc>"
    r1 = run(env.step(act(a1)))
    assert not r1.done and r1.reward == 0.0
    assert r1.observation.startswith(state0 + a1) and r1.observation.endswith("<result>84</result>\n")

    a2 = " then <calc>84+3</calc>"
    r2 = run(env.step(act(a2)))  # second tool call: a summary, not an extension
    assert not r2.observation.startswith(r1.observation + a2)
    assert r2.observation.startswith(state0) and "12*7=84" in r2.observation and "84+3=87" in r2.observation

    r3 = run(env.step(act("<answer>87</answer>")))
    assert r3.done and r3.reward == 1.0 and r3.observation is None and r3.info["correct"]


def test_calculator_wrong_answer_nudge_budget_and_max_turns():
    env = CalculatorEnv(max_turns=3, summarize_every=0, nudge="?")
    state0 = run(env.reset({"expression": "2+3"}))
    r1 = run(env.step(act("hmm")))  # no tag: the nudge is appended
    assert r1.observation == state0 + "hmm?" and not r1.done
    env = CalculatorEnv(max_turns=3, summarize_every=0, max_state_chars=len(state0) + 10, nudge="?")
    run(env.reset({"expression": "2+3"}))
    r = run(env.step(act("a long rambling action text")))  # would pass the budget: fresh summary
    assert not r.observation.startswith(state0 + "a long") and r.observation.startswith(state0)
    r = run(env.step(act("<calc>2+3</calc>")))
    r = run(env.step(act("still thinking")))  # third action: out of turns
    assert r.done and r.reward == 0.0 and r.info["out_of_turns"]
    run(env.reset({"expression": "2+3"}))
    wrong = run(env.step(act("<answer>6</answer>")))
    assert wrong.done and wrong.reward == 0.0


def test_calculator_is_deterministic_and_resets_state():
    actions = ["<calc>1+1</calc>", "x", "<calc>2*2</calc>", "<answer>4</answer>"]

    def play(env):
        out = [run(env.reset({"expression": "2*2"}))]
        for a in actions:
            r = run(env.step(act(a)))
            out.append((r.observation, r.reward, r.done))
        return out

    env = CalculatorEnv(max_turns=6)
    first = play(env)
    assert play(env) == first == play(CalculatorEnv(max_turns=6))
    assert first[-1][1:] == (1.0, True)


def test_sentiment_env_left_pads_to_query_length():
    env = SentimentEnv(query_length=6, pad_token_id=1)
    assert run(env.reset({"query_ids": [5, 6, 7]})) == [1, 1, 1, 5, 6, 7]
    assert run(env.reset({"query_ids": list(range(10, 20))})) == list(range(14, 20))
    result = run(env.step(Action("text", [3, 4, 5], "length")))
    assert result.done and result.reward == 0.0 and result.observation is None
    assert result.info["response_tokens"] == 3
    with pytest.raises(KeyError, match="query_ids"):
        run(env.reset({"text": "no ids"}))
    with pytest.raises(ValueError, match="pad_token_id"):
        SentimentEnv(query_length=4)


def test_example_env_rewards_target_length():
    env_cls = load_env_class("envs.examples.echo_length:TargetLengthEnv")
    env = env_cls(target_words=4)
    assert run(env.reset({"text": "hello"})) == "hello"
    exact = run(env.step(act("one two three four")))
    off = run(env.step(act("one two")))
    assert exact.reward == 1.0 and 0.0 < off.reward < 1.0 and exact.done


STUCK_ENV_SCRIPT = """
import asyncio, itertools, sys, threading, time
from envs.base import Action, StepResult, SyncEnv, make_env_factory, make_executor
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
    from envs.base import EnvThreadPool

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
