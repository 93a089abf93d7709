"""Reward functions: plain Python callables named by import path, beside (or instead of) a reward model.

A reward function scores one finished trajectory from its final response text and its dataset
row, so a new task needs no framework change:

    def my_reward(completion: str, sample: dict, **kwargs) -> float: ...
    async def my_remote_reward(completion: str, sample: dict, **kwargs) -> float: ...

`sample` is the prompt's dataset row with every column (e.g. `answer`). A function marked `@batched`
scores a whole rollout in one call (lists in, a list out), as TRL's reward functions do:

    @batched
    def my_batch_reward(completions: list[str], samples: list[dict], **kwargs) -> list[float]: ...

which saves a worker round trip per completion for cheap scorers. A function that declares a `messages`
and/or `tool_calls` parameter also gets the trajectory's conversation (conversation envs, envs/chat.py):

    def my_tool_reward(completion: str, sample: dict, messages: list[dict], tool_calls: list[dict]) -> float: ...

`messages` are the rendered chat messages (role/content dicts, tool results included), `tool_calls` every
call parsed from the model's turns (`{"id", "name", "arguments", "problem"}`); both are None for envs that
are not conversations, and lists of them, one per completion, for a `@batched` function. The config names them
with weights (`reward.fns: {name: {fn: "pkg.module:function", weight: 1.0, kwargs: {...}}}`);
the trajectory's reward is the weighted sum and every component is logged on its own. Sync
functions run in worker processes (`reward.fn_processes`, see workers.py; 0 = a thread pool),
async ones on the rollout's event loop, each call under
`reward.fn_timeout_s`: the loop that drives hundreds of trajectories never waits on a slow
checker. A function that raises, times out or returns something other than a finite number
fails its trajectory the way an env failure does (left out of training, counted). Multi-turn
tasks whose reward comes from acting in the world are envs (`envs/base.py`).
Shipped functions: `rl_core.rewards.math` (answer checker, format reward), `rl_core.rewards.match` (an exact
one-word or one-number answer).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from math import isfinite
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Callable

from envs.plugins import load_by_path


class RewardFnError(RuntimeError):
    """A reward function raised, timed out or returned something unusable; its trajectory fails."""


def load_reward_fn(import_path: str) -> Callable:
    """The callable at "pkg.module:function", or an error that says what was found."""
    fn = load_by_path(import_path, "reward function", "rl_core.rewards.math:answer_reward")
    if not callable(fn):
        raise ImportError(f"{import_path!r} is {fn!r}, not a callable (completion, sample, **kwargs) -> float")
    return fn


def batched(fn: Callable) -> Callable:
    """Mark `fn` as scoring a batch: `fn(completions, samples, **kwargs) -> list of numbers`, one per completion."""
    fn.scores_batches = True
    return fn


CONVERSATION_PARAMS = ("messages", "tool_calls")


@dataclass
class RewardFn:
    name: str
    fn: Callable
    weight: float = 1.0
    kwargs: dict = field(default_factory=dict)
    conversation_params: tuple = field(init=False)  # which of CONVERSATION_PARAMS `fn` declares

    def __post_init__(self):
        try:
            params = inspect.signature(self.fn).parameters
        except (TypeError, ValueError):  # a builtin without a signature: it takes none of them
            params = {}
        self.conversation_params = tuple(p for p in CONVERSATION_PARAMS if p in params)

    def conversation_kwargs(self, conversation: dict | None) -> dict:
        """The parts of a trajectory's conversation (`info["conversation"]`) this function asked for."""
        return {p: (conversation or {}).get(p) for p in self.conversation_params}

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn)

    @property
    def is_batched(self) -> bool:
        return bool(getattr(self.fn, "scores_batches", False))


class RewardFunctions:
    """The configured reward functions; `score` runs them all on one completion."""

    def __init__(self, fns: list[RewardFn], timeout_s: float = 30.0, executor: Executor | None = None):
        self.fns, self.timeout_s, self.executor = fns, timeout_s, executor

    @classmethod
    def from_config(cls, specs: dict[str, dict], timeout_s: float, executor: Executor | None = None) -> "RewardFunctions":
        """`specs` as in `reward.fns`: {name: {fn, weight, kwargs}}; every import happens here, up front."""
        fns = [RewardFn(name, load_reward_fn(spec["fn"]), float(spec.get("weight", 1.0)), dict(spec.get("kwargs") or {}))
               for name, spec in specs.items()]
        return cls(fns, timeout_s, executor)

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.fns]

    def __bool__(self) -> bool:
        return bool(self.fns)

    async def score(self, completion: str, sample: dict, conversation: dict | None = None) -> dict[str, float]:
        """Every component's value for one completion; RewardFnError on any failure."""
        (result,) = await self.score_batch([completion], [sample], [conversation])
        if isinstance(result, RewardFnError):
            raise result
        return result

    async def score_batch(self, completions: list[str], samples: list[dict],
                          conversations: list[dict | None] | None = None) -> list[dict[str, float] | RewardFnError]:
        """Every component's value for each completion, all functions concurrently: a batched one in one call,
        any other once per completion. A completion whose function failed gets the RewardFnError instead.
        `conversations`: each completion's `info["conversation"]` (None: not a conversation env)."""
        conversations = conversations or [None] * len(completions)
        per_fn = await asyncio.gather(*(self._values(f, completions, samples, conversations) for f in self.fns))
        results: list[dict[str, float] | RewardFnError] = []
        for k in range(len(completions)):
            failed = next(((f, values[k]) for f, values in zip(self.fns, per_fn) if isinstance(values[k], Exception)), None)
            if failed is not None:
                f, err = failed
                error = RewardFnError(f"reward function {f.name!r} failed: {err}")
                error.__cause__ = err
                results.append(error)
            else:
                results.append({f.name: values[k] for f, values in zip(self.fns, per_fn)})
        return results

    def total(self, components: dict[str, float]) -> float:
        return sum(f.weight * components[f.name] for f in self.fns)

    async def _values(self, f: RewardFn, completions: list[str], samples: list[dict],
                      conversations: list[dict | None]) -> list[float | Exception]:
        """`f`'s number for each completion, or the exception that stands for it."""
        extras = [f.conversation_kwargs(c) for c in conversations]
        if not f.is_batched:
            return await asyncio.gather(*(self._one(f, c, s, e) for c, s, e in zip(completions, samples, extras)),
                                        return_exceptions=True)
        try:
            per_completion = {p: [e[p] for e in extras] for p in f.conversation_params}
            values = await self._call(f, completions, samples, per_completion)
            if not isinstance(values, (list, tuple)) or len(values) != len(completions):
                raise RewardFnError(f"returned {type(values).__name__} of {len(values) if hasattr(values, '__len__') else '?'} "
                                    f"values for {len(completions)} completions; a batched reward function returns one "
                                    "number per completion")
        except Exception as err:  # the whole call failed: every completion of it did
            return [err] * len(completions)
        out: list[float | Exception] = []
        for value in values:
            try:
                out.append(_as_number(value))
            except RewardFnError as err:
                out.append(err)
        return out

    async def _one(self, f: RewardFn, completion: str, sample: dict, extra: dict) -> float:
        return _as_number(await self._call(f, completion, sample, extra))

    async def _call(self, f: RewardFn, completion, sample, extra: dict) -> Any:
        """`extra`: the conversation parts `f` declares (`RewardFn.conversation_kwargs`)."""
        kwargs = {**f.kwargs, **extra}
        if f.is_async:
            call = f.fn(completion, sample, **kwargs)
        else:  # blocking checkers (sympy, subprocesses, HTTP) must not stall the rollout's event loop
            loop = asyncio.get_running_loop()  # a partial, not a lambda: worker processes receive it pickled
            call = loop.run_in_executor(self.executor, functools.partial(f.fn, completion, sample, **kwargs))
        try:
            return await asyncio.wait_for(call, self.timeout_s)
        except asyncio.TimeoutError:
            raise RewardFnError(f"timed out after {self.timeout_s} s (reward.fn_timeout_s)") from None


def _as_number(value: Any) -> float:
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, (int, float)) or not isfinite(value):
        raise RewardFnError(f"returned {value!r}; a reward function must return a finite number")
    return float(value)
