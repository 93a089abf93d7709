"""Rank 0's rollout side: an asyncio loop in a background thread that talks to the router (in a thread of
rank 0's trainer, or of the rollout process in async mode: `rl_core.rollout.process`).

Sync mode asks it for one batch at a time (`collect`). Async mode starts a producer that keeps
generating batches into a bounded queue while the trainer trains; `next_batch` hands out
trajectories no staler than `max_staleness` policy versions and counts the ones it drops.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from typing import Callable, Protocol

from envs.chat import ChatSetup
from envs.factory import make_env_factory
from envs.pool import EnvPool
from envs.threads import make_executor
from rl_core.rewards import RewardFunctions
from rl_core.rewards.processes import ProcessExecutor
from rl_core.rollout.rollout import (GroupRule, KeepFn, RolloutParts, RolloutResult, RolloutSettings, rollout,
                                     rollout_until)
from rl_core.rollout.trajectory import Trajectory
from workers.engines.client import EngineClient

# What the service hands the job: the kept trajectories and the rollout's metrics (failures counted there).
Collected = tuple[list[Trajectory], dict[str, float]]


def kept_and_metrics(result: RolloutResult) -> Collected:
    return result.trajectories, result.metrics


class PromptStream(Protocol):
    """Prompt batches whose position can be saved and restored (rollout.prompts.PromptSamples)."""

    def __next__(self) -> list[dict]: ...

    def state_dict(self) -> dict: ...


class GatedClient:
    """An EngineClient whose new generate calls wait while the gate is closed.

    `hold` closes the gate and returns once every call already sent has been answered, so the
    engines are idle (async mode without partial rollout: requests finish on the old weights).
    """

    def __init__(self, client: EngineClient):
        self.client = client
        self.open = asyncio.Event()
        self.open.set()
        self.in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()

    async def generate(self, *args, **kwargs):
        await self.open.wait()
        self.in_flight += 1
        self.idle.clear()
        try:
            return await self.client.generate(*args, **kwargs)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self.idle.set()

    async def hold(self) -> None:
        self.open.clear()
        await self.idle.wait()

    async def release(self) -> None:
        self.open.set()

    async def close(self) -> None:
        await self.client.close()


class RolloutService:
    """`env`: the env section (`num_envs`, `step_timeout_s`, `max_failed_ratio`); `served_version()`: the
    policy version the engines serve now (the async producer tags batches with it). `on_close`: what
    else to stop after the rollout (the envs' and reward functions' executors, MCP servers)."""

    def __init__(self, router_url: str, tokenizer, env_factory, env, settings: RolloutSettings,
                 reward_fns: RewardFunctions | None = None, served_version: Callable[[], int] = lambda: 0,
                 processor=None):
        self.settings = settings
        self.served_version = served_version
        self.on_close: list[Callable[[], None]] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="rollout-loop", daemon=True)
        self.thread.start()
        # aiohttp sessions and the pool's semaphore belong to the loop they are created on.
        router = EngineClient(router_url, timeout_s=settings.engine_timeout_s, label="router")
        self.client = self._call(self._make(GatedClient, router))
        self.env_pool = self._call(self._make(EnvPool, env_factory, num_envs=env.num_envs,
                                              step_timeout_s=env.step_timeout_s,
                                              max_failed_ratio=env.max_failed_ratio))
        self.parts = RolloutParts(self.client, self.env_pool, tokenizer, reward_fns, processor)
        self.batches: queue.Queue = queue.Queue()
        self.producer: asyncio.Future | None = None
        self.stop_producing = threading.Event()
        self.extra_batches = 0  # batches taken beyond one a step (the producer's staleness gate counts them)
        self.batches_generated = 0
        # Async resume point: the prompt stream's state after the last batch the trainer took.
        # Batches still queued or being generated are not in it, so a resumed run generates them again.
        self.resume_state: dict | None = None
        self.batches_taken = 0

    @staticmethod
    async def _make(cls, *args, **kwargs):
        return cls(*args, **kwargs)

    def _call(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _rollout(self, samples: list[dict], version: int | Callable[[], int],
                       settings: RolloutSettings | None = None) -> RolloutResult:
        return await rollout(samples, settings or self.settings, self.parts, version)

    def collect(self, samples: list[dict], version: int) -> Collected:
        """Sync mode: generate one batch with the current policy and wait for it."""
        return kept_and_metrics(self._call(self._rollout(samples, version)))

    def collect_groups(self, groups, n_groups: int, keep_fn: KeepFn, max_groups: int, version: int) -> Collected:
        """Sync mode, dynamic sampling: draw prompt groups until `n_groups` pass `keep_fn` (at most
        `max_groups` launched; then the batch is topped up with dropped groups)."""
        rule = GroupRule(keep=keep_fn, max_groups=max_groups, fill_with_dropped=True)
        return kept_and_metrics(self._call(rollout_until(n_groups, groups, self.settings, self.parts, version, rule)))

    def evaluate(self, samples: list[dict], sampling_params: dict, version: int) -> Collected:
        """Held-out prompts with the eval sampling settings (greedy by default)."""
        return kept_and_metrics(self._call(self._rollout(samples, version,
                                                         self.settings.with_sampling(sampling_params))))

    # ------------------------------------------------------------------ async mode

    def hold(self) -> None:
        """Stop sending new engine calls and wait for the running ones: engines drain before a push."""
        self._call(self.client.hold())

    def release(self) -> None:
        self._call(self.client.release())

    def start_producer(self, sample_batches: PromptStream, max_queued: int, max_staleness: int,
                       in_flight: int = 1) -> None:
        """Keep generating batches (at most `in_flight` at once, at most `max_queued` waiting) until `close`.

        Bounded staleness at the source: the trainer takes one batch a step, so batch i (counted from here) is
        started only once the engines serve a version that will still be within `max_staleness` of the
        trainer's when it takes it. A batch started earlier would be dropped as stale: generated, never
        trained on. A step that takes more than one batch (failures left the first short) moves the schedule
        on by one, so the batch it waits for is never held back. A batch counts as in flight until it is
        queued, and batches are queued in the order they started (the resume point follows that order)."""
        self.batches = queue.Queue(maxsize=max_queued)
        self.resume_state = sample_batches.state_dict()
        current_version = self.served_version
        first_version = current_version()
        slots = asyncio.Semaphore(in_flight)
        started: asyncio.Queue = asyncio.Queue()  # (the batch's rollout, the prompt position after it), in order

        async def start_batches():
            for index in itertools.count():
                while (current_version() - first_version < index - self.extra_batches - max_staleness
                       and not self.stop_producing.is_set()):
                    await asyncio.sleep(0.005)
                await slots.acquire()
                if self.stop_producing.is_set():
                    break
                samples = next(sample_batches)
                position = sample_batches.state_dict()
                started.put_nowait((asyncio.ensure_future(self._rollout(samples, current_version)), position))

        async def queue_batches():
            while True:
                rollout, position = await started.get()
                result = await rollout  # its error (engine died, envs failing) ends the producer
                self.batches_generated += 1
                while not self.stop_producing.is_set():
                    try:
                        self.batches.put_nowait((result, position))
                        break
                    except queue.Full:
                        await asyncio.sleep(0.01)
                slots.release()

        async def produce():
            await asyncio.gather(start_batches(), queue_batches())

        self.producer = asyncio.run_coroutine_threadsafe(produce(), self.loop)

    def next_batch(self, batch_size: int, current_version: int, max_staleness: int) -> tuple[Collected, int]:
        """Take `batch_size` fresh-enough trajectories from the producer; returns (batch, dropped count).

        Staleness counts from the oldest token of a trajectory (partial rollouts mix versions).
        Fresh trajectories beyond ``batch_size`` in the last batch taken are discarded and counted
        in ``async/surplus_discarded``: every batch taken is then fully used, which keeps the
        resume point exact.
        """
        kept, metrics, dropped, surplus = [], {}, 0, 0
        first = self.batches_taken
        while len(kept) < batch_size:
            if self.batches_taken > first:  # a second batch this step: the producer's schedule moves on by one
                self.extra_batches += 1
            result, self.resume_state = self._get_result()
            self.batches_taken += 1
            for traj in result.trajectories:
                if current_version - traj.min_version > max_staleness:
                    dropped += 1
                elif len(kept) < batch_size:
                    kept.append(traj)
                else:
                    surplus += 1
            metrics = dict(result.metrics)
        metrics.update({"async/surplus_discarded": surplus, "async/batches_taken": self.batches_taken,
                        "async/batches_generated": self.batches_generated})
        return (kept, metrics), dropped

    def _get_result(self) -> tuple[RolloutResult, dict]:
        while True:
            if self.producer is not None and self.producer.done():
                self.producer.result()  # re-raises the producer's error (engine died, envs failing)
                raise RuntimeError("the rollout producer stopped unexpectedly")
            try:
                return self.batches.get(timeout=0.5)
            except queue.Empty:
                continue

    # ------------------------------------------------------------------ shutdown

    def close(self) -> None:
        self.stop_producing.set()
        if self.producer is not None:
            self.producer.cancel()
        try:
            self._call(self._shutdown(), timeout=30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)
            if not self.thread.is_alive():
                self.loop.close()
            for close in self.on_close:
                close()

    async def _shutdown(self) -> None:
        # A stop signal can leave a rollout running on this loop (the main thread stopped waiting
        # for it): cancel it and let it unwind before its HTTP session is closed under it.
        running = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        await self.client.close()
        await self.env_pool.close()


def build_service(env, reward, router_url: str, tokenizer, settings: RolloutSettings, vision_model_path: str | None,
                  served_version: Callable[[], int]) -> RolloutService:
    """A job's rollout side from its `env` and `reward` sections, built where it runs (rank 0's process or
    the rollout process): the envs' and reward functions' executors and MCP servers stop with it.
    `vision_model_path`: a vision-language policy's path, whose processor expands the prompts' image pads."""
    env_executor = make_executor(env.thread_pool_size)
    closers = [lambda: env_executor.shutdown(wait=False, cancel_futures=True)]  # never wait on a stuck env call
    try:
        reward_fns = None
        if reward.fns:
            if reward.fn_processes > 0:
                reward_executor = ProcessExecutor(reward.fn_processes)
            else:
                reward_executor = make_executor(env.thread_pool_size)
            closers.append(lambda: reward_executor.shutdown(wait=False, cancel_futures=True))
            reward_fns = RewardFunctions.from_config(reward.fns, reward.fn_timeout_s, reward_executor)
        chat = ChatSetup.build(tokenizer, list(env.tools), env.tool_parser, env.reasoning_parser,
                               dict(env.chat_template_kwargs), env.max_result_tokens,
                               {"timeout_s": env.tool_timeout_s, "max_threads": env.thread_pool_size,
                                "max_concurrent": env.tool_concurrency})
        closers.append(chat.close)  # after the envs (no call is running): its MCP servers stop
        env_factory = make_env_factory(env.cls, dict(env.kwargs), env_executor, chat)
        processor = None
        if vision_model_path is not None:  # imported here: a text job's rollout process never loads torch
            from workers.vision import load_processor
            processor = load_processor(vision_model_path)
        service = RolloutService(router_url, tokenizer, env_factory, env, settings, reward_fns, served_version,
                                 processor)
    except BaseException:
        for close in closers:
            close()
        raise
    service.on_close += closers
    return service
