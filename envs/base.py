"""The environment interface: a small async class driven by the rollout on rank 0.

An environment sees one trajectory at a time:

    obs = await env.reset(sample)          # first state: text, token ids, or None (use the sample's prompt)
    result = await env.step(action)        # next state (or None), reward, done, info
    await env.close()                      # when the pool drops the env

Observations are text or token ids. Text is tokenized by the framework on its own and
concatenated as tokens; token ids are used as they are. Blocking environments (subprocess
sandboxes, HTTP clients without asyncio, slow reward functions) subclass `SyncEnv` and are
wrapped in `SyncEnvAdapter`, which runs every call in a thread pool so the event loop that
drives hundreds of trajectories never stalls. A blocking call that never returns costs its
trajectory (the pool's `step_timeout_s`) and its thread, never the job: the pool's threads are
daemons that nobody waits for at exit, and an abandoned call's slot goes to a fresh thread.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import queue
import threading
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any, Callable, Union

from envs.plugins import load_by_path

Observation = Union[str, list[int]]


@dataclass
class Action:
    """What the policy did this turn: the engine's token ids and the framework's decode of them."""

    text: str
    token_ids: list[int]
    finish_reason: str = "stop"
    logprobs: list[float] = field(default_factory=list)  # the engine's, one per id


@dataclass
class StepResult:
    """The env's answer to an action. `observation=None` means there is no next state."""

    observation: Observation | None
    reward: float = 0.0
    done: bool = False
    info: dict = field(default_factory=dict)


class Env:
    """Async environment. Subclass and implement `reset` and `step`; `close` is optional.

    Constructor arguments come from the config (`env.kwargs`), so keep them plain values.
    One instance serves many trajectories in turn (the pool reuses it), so `reset` must
    clear any per-trajectory state.
    """

    async def reset(self, sample: dict) -> Observation | None:
        """Start a trajectory for one dataset row; return the first state (None: use the sample's prompt)."""
        raise NotImplementedError

    async def step(self, action: Action) -> StepResult:
        """Apply the policy's action and return the next state, the reward it earned and `done`."""
        raise NotImplementedError

    async def close(self) -> None:
        """Release resources (processes, connections). Called once, when the pool drops the env."""

    def next_sampling(self) -> dict:
        """Sampling params for the next action over the job's: `max_new_tokens` (only lower) and `stop_token_ids`
        (added). An agent's request asks for these (envs/agent.py); most envs leave the job's as they are."""
        return {}

    async def finish(self) -> None:
        """The trajectory ended (done, out of turns or context, failed): stop what it left running."""


class SyncEnv:
    """Blocking twin of `Env`, for environments written without asyncio.

    Same methods, without `async`. Wrap an instance in `SyncEnvAdapter` (the env factory does
    this for you) so each call runs in a worker thread.
    """

    def reset(self, sample: dict) -> Observation | None:
        raise NotImplementedError

    def step(self, action: Action) -> StepResult:
        raise NotImplementedError

    def close(self) -> None:
        pass


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


class SyncEnvAdapter(Env):
    """Presents a `SyncEnv` as an async `Env` by running each of its calls in a thread pool."""

    def __init__(self, env: SyncEnv, executor: Executor):
        self.env = env
        self.executor = executor

    async def reset(self, sample: dict) -> Observation | None:
        return await run_blocking(self.executor, self.env.reset, sample)

    async def step(self, action: Action) -> StepResult:
        return await run_blocking(self.executor, self.env.step, action)

    async def close(self) -> None:
        await run_blocking(self.executor, self.env.close)


def load_env_class(import_path: str) -> type:
    """Import an env class from "pkg.module:ClassName" or "pkg.module.ClassName".

    The class must subclass `Env`, `SyncEnv` or `envs.chat.ChatEnv`; anything else is refused with a
    message that says what was found and what is expected.
    """
    from envs.chat import ChatEnv  # envs.chat builds on this module

    env_cls = load_by_path(import_path, "env class", "envs.sentiment:SentimentEnv")
    if not (inspect.isclass(env_cls) and issubclass(env_cls, (Env, SyncEnv, ChatEnv))):
        raise TypeError(
            f"{import_path!r} is {env_cls!r}, not an environment class: subclass envs.base.Env (async), "
            "envs.base.SyncEnv (blocking) or envs.chat.ChatEnv (chat messages and tools)"
        )
    return env_cls


def make_env_factory(env_cls: type | str, env_kwargs: dict | None = None,
                     executor: Executor | None = None, chat: Any = None) -> Callable[[], Env]:
    """A zero-argument callable building one async `Env` per call (for `EnvPool`).

    `env_cls` may be a class or an import path. `SyncEnv` classes are wrapped in
    `SyncEnvAdapter` running on `executor` (required for them); `ChatEnv` classes get `chat`'s
    toolbox and are wrapped in `ChatEnvAdapter` with its tokenizer and tool-call parser
    (`envs.chat.ChatSetup`, required for them).
    """
    from envs.chat import ChatEnv, ChatEnvAdapter

    if isinstance(env_cls, str):
        env_cls = load_env_class(env_cls)
    kwargs = dict(env_kwargs or {})
    if issubclass(env_cls, SyncEnv) and executor is None:
        raise ValueError(f"{env_cls.__name__} is a blocking SyncEnv: pass an executor (envs.base.make_executor(n))")
    is_chat = issubclass(env_cls, ChatEnv) or getattr(env_cls, "wants_chat", False)
    if is_chat and chat is None:
        raise ValueError(f"{env_cls.__name__} is a ChatEnv: pass chat=envs.chat.ChatSetup(tokenizer, toolbox, parser)")
    if not is_chat and chat is not None and chat.toolbox is not None:
        raise ValueError(f"env.tools is set but {env_cls.__name__} is not a chat env that calls them: subclass "
                         "envs.chat.ChatEnv (or use envs.chat:ToolUseEnv), or remove env.tools")

    def build() -> Env:
        if getattr(env_cls, "wants_chat", False):  # an Env that renders chats itself (envs/agent.py)
            return env_cls(chat=chat, **kwargs)
        if is_chat:
            return ChatEnvAdapter(env_cls(toolbox=chat.toolbox, **kwargs), chat.tokenizer, chat.parser,
                                  chat.max_result_tokens, chat.template_kwargs)
        env = env_cls(**kwargs)
        return SyncEnvAdapter(env, executor) if isinstance(env, SyncEnv) else env

    return build
