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
daemons that nobody waits for at exit, and an abandoned call's slot goes to a fresh thread
(`envs.threads`). Building envs from the job's config: `envs.factory`.
"""

from __future__ import annotations

from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Union

from envs.threads import run_blocking

Observation = Union[str, list[int]]
"""A state of the trajectory, whole: text, or token ids.

The first state (`Env.reset`) is the prompt. A later one (`StepResult.observation`) that extends the state so
far, the previous state followed by the action's text (or ids), is appended to the same token sequence: only
its new part is tokenized, on its own. Anything else starts a new sequence of the trajectory with that state
as its context."""


@dataclass
class Action:
    """What the policy did this turn: the engine's token ids and the framework's decode of them.

    Attributes:
        text: The response, decoded from `token_ids` without special tokens.
        token_ids: The ids the engine sampled, as it sampled them.
        finish_reason: Why generation stopped: "stop" (EOS or a stop token), "length" (the token limit) or
            another reason the engine gave.
        logprobs: The engine's logprob of each id (pi_behaviour).
    """

    text: str
    token_ids: list[int]
    finish_reason: str = "stop"
    logprobs: list[float] = field(default_factory=list)  # the engine's, one per id


@dataclass
class StepResult:
    """The env's answer to an action.

    Attributes:
        observation: The next state (see `Observation`); None ends the trajectory.
        reward: Earned by this action: put on its last token, and added to the trajectory's total reward.
        done: True ends the trajectory.
        info: Details kept with the trajectory (`Trajectory.info`); a number under a key `agent/<name>` is
            averaged over the batch into the metric `rollout/agent/<name>`.
    """

    observation: Observation | None
    reward: float = 0.0
    done: bool = False
    info: dict = field(default_factory=dict)


class Env:
    """Async environment. Subclass and implement `reset` and `step`; `close` is optional.

    The job builds it by import path (`env.cls`) with the keyword arguments of `env.kwargs`, so keep them
    plain values. One instance serves many trajectories in turn (the pool reuses it), so `reset` must
    clear any per-trajectory state. A call that raises or runs past `env.step_timeout_s` fails its
    trajectory only (left out of training, counted in `rollout/failed`).
    """

    async def reset(self, sample: dict) -> Observation | None:
        """Start a trajectory for one dataset row; return the first state (None: use the sample's prompt).

        Args:
            sample: The prompt's dataset row with every column, plus `prompt_ids` (the encoded prompt),
                `index` (its row), `group_id` (the same for every response to the prompt) and, when
                samples are seeded, `sampling_seed`.
        """
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
    this for you) so each call runs in a worker thread, one of `env.thread_pool_size`.
    """

    def reset(self, sample: dict) -> Observation | None:
        """As `Env.reset`, in a worker thread."""
        raise NotImplementedError

    def step(self, action: Action) -> StepResult:
        """As `Env.step`, in a worker thread."""
        raise NotImplementedError

    def close(self) -> None:
        """As `Env.close`, in a worker thread."""


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
