"""One prompt, one response, no env reward: the env of tasks scored by reward functions
(`reward.fns`) or a reward model, e.g. the arithmetic and GSM8K recipes.

The first state is the sample's prompt as the data pipeline encoded it (`prompt_ids`: chat
template applied, length checked), so the engine sees exactly those tokens.
"""

from __future__ import annotations

from envs.base import Action, Env, StepResult


class SingleTurnEnv(Env):
    async def reset(self, sample: dict) -> None:
        return None  # the rollout starts from the sample's prompt_ids

    async def step(self, action: Action) -> StepResult:
        return StepResult(observation=None, reward=0.0, done=True,
                          info={"response_tokens": len(action.token_ids), "engine_finish": action.finish_reason})
